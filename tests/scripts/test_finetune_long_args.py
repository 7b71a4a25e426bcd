"""finetune_long's command line: fast --help, documented options, and bad input refused up front."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from hyscale_hf.recipes.args import PRESETS, build_parser, parse_args
from tests.scripts.test_finetune_long import SCRIPT, run_script, script_env


def test_help_is_fast_and_imports_nothing_heavy():
    probe = ("import sys\nfrom hyscale_hf.recipes.finetune_long import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], env=script_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("[]"), proc.stdout[-500:]
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], env=script_env(), capture_output=True, text=True,
                          timeout=60)
    seconds = time.perf_counter() - started
    assert proc.returncode == 0 and "--resume_from_checkpoint" in proc.stdout
    assert seconds < 1.5, f"--help took {seconds:.2f} s"


def test_every_option_is_documented_once_with_its_preset_values():
    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"
        assert action.help.count("default") <= 1, f"{action.option_strings}: default given twice: {action.help}"
    epilog = parser.epilog
    for key in PRESETS["cpu"]:
        row = next(line for line in epilog.splitlines() if line.strip().startswith(f"--{key} "))
        cells = row.split()[1:]
        assert cells == ["--" if PRESETS[p][key] is None else str(PRESETS[p][key]) for p in PRESETS], row


def _error(capsys, argv, on_gpu=False) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, on_gpu=on_gpu)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--passkey_depths", "1.5"], "--passkey_depths: [1.5] outside [0, 1]"),
    (["--passkey_depths", "half"], "--passkey_depths 'half'"),
    (["--seq_len", "0"], "--seq_len must be positive"),
    (["--tiny", "--max_steps", "10", "--logging_steps", "20"], "--logging_steps 20 exceeds --max_steps 10"),
    (["--max_steps", "20"], "--dense_pretrain_steps 0 + --dense_warmup_steps 70 exceed --max_steps 20"),
    (["--preset", "glm5", "--max_steps", "50"], "--dense_pretrain_steps 400 + --dense_warmup_steps 100 exceed --max_steps 50"),
    (["--tiny", "--preset", "cpu"], "--tiny is --preset tiny"),
    (["--tiny", "--rope_yarn_factor", "2"], "--rope_yarn_factor applies to a pretrained --model"),
    (["--rope_yarn_factor", "0.5"], "--rope_yarn_factor must be a number > 1"),
    (["--tiny", "--index_share", "2"], "--index_share applies to a pretrained --model"),
    (["--index_share", "0"], "--index_share must be positive"),
    (["--indexer_lr", "-1"], "--indexer_lr must be a positive number"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--topk", "8", "--index_topk", "16"], "--topk 8 and --index_topk 16 name the same setting"),
    (["--model", "/nonexistent"], "--model /nonexistent: no such file or folder"),
    (["--model", "/tmp", "--hidden_size", "64"], "--hidden_size shapes the built model only"),
    (["--dataset", "/nonexistent/train.jsonl"], "--dataset /nonexistent/train.jsonl: no such file or folder"),
    (["--dataset", "missing_local.jsonl"], "--dataset missing_local.jsonl: no such file or folder"),
    (["--lora_alpha", "8"], "--lora_alpha needs --lora_r > 0"),
    (["--lora_r", "4", "--lora_dropout", "1.0"], "--lora_dropout must be in [0, 1)"),
    (["--lora_r", "4", "--lora_target_modules", "q_proj,indexer"], "do not adapt it with LoRA"),
    (["--eval_fraction", "1.5"], "--eval_fraction must be in (0, 1)"),
    (["--eval_split", "validation"], "--eval_split needs a hub --dataset"),
    (["--eval_steps", "5"], "--eval_steps needs an evaluation set"),
    (["--resume_from_checkpoint", "/nonexistent/checkpoint-3"], "--resume_from_checkpoint /nonexistent/checkpoint-3: no such folder"),
    (["--resume_from_checkpoint", "--overwrite_output_dir"], "give one"),
    (["--tile_tokens", "0"], "--tile_tokens must be positive"),
    (["--offload_activations"], "--offload_activations moves what checkpointed layers keep; it needs --gradient_checkpointing"),
])
def test_bad_arguments_are_refused_by_name(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert message in _error(capsys, argv)


def test_memory_options_follow_the_context_length_unless_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    short = parse_args(["--tiny"], on_gpu=True)
    assert (short.tile_tokens, short.offload_activations) == (None, False)
    long = parse_args(["--tiny", "--seq_len", "262144"], on_gpu=True)
    assert (long.tile_tokens, long.offload_activations) == (65536, False)
    huge = parse_args(["--tiny", "--seq_len", "1048576"], on_gpu=True)
    assert (huge.tile_tokens, huge.offload_activations) == (65536, True)
    assert not parse_args(["--tiny", "--seq_len", "1048576"], on_gpu=False).offload_activations  # host memory already
    given = parse_args(["--tiny", "--seq_len", "1048576", "--tile_tokens", "4096", "--no_offload_activations"],
                       on_gpu=True)
    assert (given.tile_tokens, given.offload_activations) == (4096, False)


def test_model_folder_without_config(capsys, tmp_path):
    assert f"--model {tmp_path}: not a model folder (no config.json" in _error(capsys, ["--model", str(tmp_path)])


def test_preset_values_fill_what_is_left_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parse_args(["--max_steps", "2", "--dense_pretrain_steps", "1", "--dense_warmup_steps", "1"], on_gpu=False)
    assert (args.seq_len, args.logging_steps, args.passkey_length) == (1024, 2, 1024)  # preset logging interval capped
    assert parse_args(["--index_topk", "16"], on_gpu=False).topk == 16  # the old name still works
    gpu = parse_args([], on_gpu=True)  # the real model at 16K; its top-k is seq_len / 8, set when patched
    assert (gpu.preset, gpu.model, gpu.seq_len, gpu.topk, gpu.rope_yarn_factor) == ("gpu", "smollm2", 16384, None, 2.0)
    glm5 = parse_args(["--preset", "glm5"], on_gpu=False)
    assert (glm5.model, glm5.seq_len, glm5.topk, glm5.dense_pretrain_steps) == (None, 8192, 512, 400)
    lora = parse_args(["--lora_r", "4", "--lora_target_modules", "q_proj, v_proj"], on_gpu=False)
    assert (lora.lora_alpha, lora.lora_target_modules) == (8.0, ["q_proj", "v_proj"])


def test_output_folder_is_never_overwritten_silently(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "results.json").write_text("{}")
    assert f"--output_dir {out} is not empty" in _error(capsys, ["--output_dir", str(out)])
    args = parse_args(["--output_dir", str(out), "--overwrite_output_dir"], on_gpu=False)
    from hyscale_hf.recipes.checkpoints import prepare_output_dir

    prepare_output_dir(args)  # a stale checkpoint would be what a later bare --resume_from_checkpoint picks
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]


def test_bad_input_fails_in_seconds_before_any_model(tmp_path):
    """In a fresh process: argument errors before torch is imported, a passkey length that cannot hold a
    prompt once the tokenizer is loaded; no model is built and nothing written."""
    started = time.perf_counter()
    proc = run_script(tmp_path, "--passkey_depths", "0.5,1.5", "--output_dir", str(tmp_path / "a"), expect=2)
    assert "--passkey_depths: [1.5] outside [0, 1]" in proc.stderr
    assert time.perf_counter() - started < 5
    # glm5, not --tiny's preset (its passkey prompts are 400 tokens long whatever the sequence length):
    # the byte tokenizer needs more than 256 tokens for a prompt.
    cmd = [sys.executable, str(SCRIPT), "--no_progress", "--preset", "glm5", "--seq_len", "256", "--output_dir",
           str(tmp_path / "b")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert re.search(r"--passkey_length 256: passkey prompts need more than \d+ tokens", proc.stderr)
    assert "parameters" not in proc.stdout  # the model-summary line: no model was built
    assert not any((tmp_path / "b").iterdir())


def test_setup_asks_for_expandable_cuda_segments_unless_the_environment_chose(tmp_path, monkeypatch):
    from hyscale_hf.recipes.finetune_long import setup

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    setup(parse_args(["--tiny"]))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    setup(parse_args(["--tiny"]))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
