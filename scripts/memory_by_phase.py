"""Where a training step's peak memory is: device memory by phase of one step of a benchmark stack.

Forward hooks on every decoder layer, attention, MLP and norm of the model record the memory allocated
at that point and the peak since the previous point; the step's LM loss, backward and optimizer step
are points too. The attention, MLP and norm hooks fire again in each checkpoint recompute during
backward (a decoder layer's own hooks do not: the recompute calls its forward; and a recompute stops
once it has what backward needs, so its last "<" points can be missing). The
phase whose peak is the step's peak, and what was allocated when it began, say which tensors to go
after (docs/design.md section 11). Two steps are logged: the first (kernel compiles, the optimizer
state) and the steady second. Points print as they come; a step that runs out of memory ends the run,
and the JSON keeps its points so far and the error's message (device or pinned host memory).

    python scripts/memory_by_phase.py --arm tiled_offload --seqlen 262144 --out results/   # one H200
    python scripts/memory_by_phase.py --tiny --out /tmp/phases                              # CPU smoke run

On the CPU the points are recorded without memory figures. Writes ``memory_by_phase.json``.
"""

from __future__ import annotations

import argparse
import json
import os

# Long-context steps allocate and free whole-sequence tensors of many sizes; in the caching allocator's
# fixed segments the freed space fragments (a 1M-token step failed asking 12 GiB with 18 GiB reserved
# but unallocated). Set before torch starts CUDA; a setting in the environment wins. Every arm runs
# under it.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from hyscale_hf.benchmarking.cli import require_positive
from hyscale_hf.benchmarking.memory import host_pinned_gib, is_oom, oom_message
from hyscale_hf.benchmarking.stacks import ARMS, STACKS, make_arm
from hyscale_hf.kernels import chunked_cross_entropy


class PhaseLog:
    """``(step, point, allocated GiB, peak GiB since the previous point)`` rows (None figures off CUDA),
    printed as they come, so a step that runs out of memory still shows how far it got."""

    def __init__(self, device: torch.device, *, echo: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.echo = echo
        self.step = 0
        self.rows: list[dict] = []

    def point(self, name: str) -> None:
        row = {"step": self.step, "point": name, "allocated_gib": None, "peak_since_previous_gib": None}
        if self.cuda:
            torch.cuda.synchronize()
            row["allocated_gib"] = torch.cuda.memory_allocated() / 2**30
            row["peak_since_previous_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        self.rows.append(row)
        if self.echo:
            figures = ("" if row["allocated_gib"] is None else
                       f"allocated {row['allocated_gib']:7.2f} GiB, peak since previous {row['peak_since_previous_gib']:7.2f} GiB")
            print(f"step {self.step} {name:<34} {figures}", flush=True)

    def hook(self, name: str):
        return lambda *args: self.point(name)


def watch(model: torch.nn.Module, log: PhaseLog, detail: bool = False) -> None:
    """Points before and after every decoder layer and its attention, MLP and norms; with ``detail`` also
    around every linear projection inside the attention (its query and key projections, the indexer's,
    ``o_proj``), which splits the attention's own peak: the gap between the indexer's last projection and
    the first query-head projection is the selection, and a tiled layer's query side shows tile by tile."""
    for i, layer in enumerate(model.model.layers):
        parts = {"layer": layer, "attn": layer.self_attn, "mlp": layer.mlp,
                 "norm1": layer.input_layernorm, "norm2": layer.post_attention_layernorm}
        if detail:
            parts |= {f"attn.{name}": m for name, m in layer.self_attn.named_modules()
                      if isinstance(m, torch.nn.Linear)}
        for name, module in parts.items():
            module.register_forward_pre_hook(log.hook(f"L{i}.{name} >"))
            module.register_forward_hook(log.hook(f"L{i}.{name} <"))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=sorted(STACKS), default="glm5")
    p.add_argument("--arm", choices=ARMS, default="tiled_offload")
    p.add_argument("--seqlen", type=int, default=262144)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the stack's)")
    p.add_argument("--loss-chunk", type=int, default=16384, help="tokens per LM-head/cross-entropy chunk")
    p.add_argument("--tile-tokens", type=int, default=65536, help="tile_tokens of the tiled arms")
    p.add_argument("--detail", action="store_true", help="also points around the attention's linear projections")
    p.add_argument("--tiny", action="store_true", help="toy dims on the CPU (smoke test)")
    p.add_argument("--out", default="outputs/memory_by_phase")
    args = p.parse_args(argv)
    require_positive(p, args, *("seqlen", "loss_chunk", "tile_tokens"))
    stack = STACKS[args.stack]
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dims = stack["tiny"] if args.tiny else stack["dims"]
    T = 64 if args.tiny else args.seqlen
    tile = 16 if args.tiny else args.tile_tokens
    layers = args.layers or stack["layers"]
    model, optimizer = make_arm(args.stack, args.arm, dims, layers, T, device, dtype, tile_tokens=tile)
    ids = torch.randint(3, dims["vocab_size"], (1, T), generator=torch.Generator().manual_seed(T)).to(device)
    chunk = min(args.loss_chunk, T)

    log = PhaseLog(device)
    watch(model, log, detail=args.detail)

    def step():
        optimizer.zero_grad(set_to_none=True)
        log.point("start (weights, optimizer state)")
        hidden = model.model(input_ids=ids).last_hidden_state
        loss = chunked_cross_entropy(hidden[:, :-1], model.get_output_embeddings(), ids[:, 1:], chunk)
        log.point("loss computed")
        loss.backward()
        log.point("backward done")
        optimizer.step()
        log.point("optimizer step")

    # Step 1 compiles kernels and makes the optimizer state; step 2 is the steady one. Both are logged:
    # at a length that does not fit, the first step's points say where memory ran out.
    error = None
    for log.step in (1, 2):
        try:
            step()
        except Exception as err:  # noqa: BLE001 - only running out of memory is expected; others re-raised
            if not is_oom(err):
                raise
            error = oom_message(err)
            print(f"step {log.step}: out of memory after {log.rows[-1]['point']!r}: {error}", flush=True)
            break
    peaks = [r for r in log.rows if r["peak_since_previous_gib"] is not None and r["step"] == log.step]
    top = max(peaks, key=lambda r: r["peak_since_previous_gib"]) if peaks else None
    result = {"stack": args.stack, "arm": args.arm, "T": T, "layers": layers, "tile_tokens": tile,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": log.rows,
              "peak_point": top["point"] if top else None, "oom": error,
              "host_pinned_peak_gib": host_pinned_gib() if device.type == "cuda" else None}
    if top:
        print(f"step {log.step} peak {top['peak_since_previous_gib']:.2f} GiB, in the phase ending at {top['point']!r}")
    if result["host_pinned_peak_gib"] is not None:
        print(f"pinned host memory peak {result['host_pinned_peak_gib']:.1f} GiB")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory_by_phase.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
