"""Probe: how much do neighbouring queries share their selected keys, in the benchmark step?

A backward that sums a tile of queries' contributions per key before its atomics (or a key-major
pass over shared keys) pays only if neighbouring queries select the same keys. This probe takes the
selections HyTopK makes in one forward of the benchmark stack (``stacks.make_arm(..., "hyscale")``,
random init, random tokens, as ``bench_e2e.py`` times it) and, for comparison,
``realistic_selection`` (sinks, a local window, far tokens), and prints per tile size G:
- ``union / pairs``: distinct keys of a tile of G consecutive queries over their selected pairs
  (1/G: all share; 1: none does);
- ``shared``: the share of pairs whose key at least G/2 of the tile's queries selected;
and per selection the share of pairs in each query's last 1024 positions (``hyscale_hf.benchmarking.
selections``; ``bench_trained_selections.py`` measures a trained indexer's selections). Writes JSON.

    python scripts/probe_selection_sharing.py --T 131072 --out results/sharing.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from hyscale_hf.benchmarking import stacks
from hyscale_hf.benchmarking.inputs import realistic_selection
from hyscale_hf.benchmarking.selections import SelectionCapture, sharing


def step_selections(T: int) -> list[torch.Tensor]:
    """The [B, T, K] indices of each HyTopK call in one forward of the glm5 hyscale arm at T tokens."""
    device = torch.device("cuda")
    dims = stacks.STACKS["glm5"]["dims"]
    model, _ = stacks.make_arm("glm5", "hyscale", dims, 2, T, device, torch.bfloat16)
    ids = torch.randint(3, dims["vocab_size"], (1, T), generator=torch.Generator().manual_seed(T)).to(device)
    cap = SelectionCapture()
    with torch.no_grad(), cap:
        model.model(input_ids=ids)
    del model
    torch.cuda.empty_cache()
    return cap.indices


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=131072)
    ap.add_argument("--out", default="outputs/probe_selection_sharing.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_selection_sharing.py runs the GLM-5-shaped stack: it needs a CUDA device")
    res = {"T": args.T, "device": torch.cuda.get_device_name(), "selections": {}}
    selections = step_selections(args.T)
    for i, idx in enumerate(selections):
        res["selections"][f"step, call {i}"] = sharing(idx[0])
    res["selections"]["realistic_selection"] = sharing(realistic_selection(args.T, selections[0].shape[-1])[0])
    same = [bool(torch.equal(selections[0], s)) for s in selections[1:]]
    res["calls_equal_to_first"] = same
    print("HyTopK calls:", len(selections), "equal to the first:", same)
    for name, s in res["selections"].items():
        tiles = "  ".join(f"{k}: union {v['union_over_pairs']:.3f} shared {v['shared']:.3f}"
                          for k, v in s.items() if k.startswith("G="))
        print(f"{name:22s} last-1024 {s['in_last_1024']:.3f}  {tiles}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
