"""The chunked cross-entropy's per-chunk math, eager against compiled (--compile on): head_pass with gradients on
one process, Llama 3's 128k vocabulary, bf16 hidden states and fp32 head as the trainer passes them.

    python bench/fused_loss.py --rows 1024 --hidden 256 --repeats 3 --write

Writes BENCHMARKS.md's fused_loss_cpu section. On a GPU the same command measures the CUDA path (its chunks are 16x
larger)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import LLAMA3_VOCAB, machine, table, update_section

from pipeline.model.vocab_parallel import CHUNK_ELEMENTS, IGNORE, head_pass


def timed(fn, repeats: int, sync) -> list[float]:
    out = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1024, help="tokens (every rank's, as the head sees them)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's fused_loss section")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    h = torch.randn(args.rows, args.hidden, device=device).to(torch.bfloat16)
    w = torch.randn(LLAMA3_VOCAB, args.hidden, device=device) * 0.02
    labels = torch.randint(0, LLAMA3_VOCAB, (args.rows,), device=device)
    labels[::50] = IGNORE
    results = {}
    for compiled in (False, True):
        def run(compiled=compiled):
            return head_pass(h, w, labels, 0, None, True, float(args.rows), compiled=compiled)

        start = time.perf_counter()
        first = run()  # the compiled path's compilation, outside the timings
        sync()
        warm = time.perf_counter() - start
        results[compiled] = (first, warm, timed(run, args.repeats, sync))
    (eager, _, t_eager), (fused, compile_s, t_fused) = results[False], results[True]
    worst_h = ((eager[1].float() - fused[1].float()).abs().max() / eager[1].float().abs().max()).item()
    worst_w = ((eager[2] - fused[2]).abs().max() / eager[2].abs().max()).item()
    rows = [["eager (in place)", f"{statistics.median(t_eager) * 1000:.0f}", "1.00", "-"],
            ["compiled chunk math", f"{statistics.median(t_fused) * 1000:.0f}",
             f"{statistics.median(t_eager) / statistics.median(t_fused):.2f}", f"{compile_s:.1f}"]]
    body = "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `python bench/fused_loss.py --rows {args.rows} --hidden {args.hidden} --repeats {args.repeats}"
        f" --write`; {args.rows} tokens x {LLAMA3_VOCAB:,} vocabulary, hidden {args.hidden}, chunks of "
        f"{CHUNK_ELEMENTS[device.type] // 2**20}M logits; median of {args.repeats}.",
        f"- Same results: loss difference {abs(eager[0] - fused[0]).item():.1e}, largest relative difference of the "
        f"hidden-state gradient {worst_h:.1e}, of the head's {worst_w:.1e}.", "",
        table(["per-chunk math", "ms per loss with gradients", "x eager", "first call (compiles), s"], rows)])
    print(body)
    if args.write:
        update_section(f"fused_loss_{device.type}", body)


if __name__ == "__main__":
    main()
