"""FlashMLA's SM90 sparse FP8 decode on this GPU: the peer anchor for bench_decode's shapes.

    python benchmarks/peer_flashmla.py --library /path/to/_flashmla_C.abi3.so
    python benchmarks/peer_flashmla.py --library ... --shapes 5,64,256 64,128,2048 --out r.json

Needs PyTorch with CUDA and FlashMLA's compiled extension, neither of which this package
depends on: e.g. ``vllm/_flashmla_C.abi3.so`` from the vLLM wheel built for the installed
torch (vLLM 0.26.0 for torch 2.11; it is loaded with ``torch.ops.load_library``, vLLM itself
is not imported). Run it next to ``bench_decode.py`` in the same session for a same-run anchor.

Method: ``torch.ops._flashmla_C.sparse_decode_fwd`` (FlashMLA's split-KV kernel and its
combine kernel) with its scheduler metadata computed once and reused, as a serving engine
does per step; CALLS calls captured in one CUDA graph, median over REPLAYS replays, GPU us
per call. Each shape's output is first checked against FP32 attention over the same
dequantized keys (a shape that fails the check is reported and not timed).

What FlashMLA computes differs from our kernel in its cache format: DeepSeek V3.2's 656-byte
token (512 E4M3 latent values with an FP32 scale per 128, then 64 BF16 RoPE values) where we
read 576 E4M3 bytes with one scale per tensor; its queries are BF16, and its heads are padded
to 64 or 128 (vLLM pads H = 96 to 128). Keys per row: ``keys`` distinct random tokens of a
131,072-token cache, all valid.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SHAPES = [
    "5,64,256",
    "5,96,256",
    "5,128,256",
    "1,128,256",
    "5,128,2048",
    "64,128,2048",
    "128,128,2048",
]  # B, H, keys: bench_decode's cases and issue #28's table
CACHE_TOKENS = 131072
PAGE = 64  # tokens per cache block
LATENT, ROPE, TILE = 512, 64, 128
TOKEN_BYTES = LATENT + 4 * (LATENT // TILE) + 2 * ROPE  # 656
SOFTMAX_SCALE = 576**-0.5
CALLS, REPLAYS = 100, 5


def parse_shape(text: str) -> tuple[int, int, int]:
    """'B,H,keys' -> (B, H, keys), all positive, H <= 128."""
    try:
        batch, heads, keys = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected B,H,keys") from None
    if min(batch, heads, keys) < 1 or heads > 128 or keys > CACHE_TOKENS:
        raise argparse.ArgumentTypeError(
            f"shape {text!r}: B, H, keys must be >= 1, H <= 128, keys <= {CACHE_TOKENS}"
        )
    return batch, heads, keys


def padded_heads(heads: int) -> int:
    """FlashMLA's sparse decode runs 64 or 128 heads; vLLM pads the queries with zeros."""
    return 64 if heads <= 64 else 128


def build_cache(torch, generator):
    """A random V3.2-format cache [blocks, PAGE, 1, 656] uint8 and its dequantization
    [tokens, 576] float32. The scales are powers of two, so the dequantized values are exact."""
    device = "cuda"
    latent = (torch.randn(CACHE_TOKENS, LATENT, device=device, generator=generator) * 64).clamp(
        -448, 448
    )
    latent = latent.to(torch.float8_e4m3fn)
    exponents = torch.randint(
        -9, -5, (CACHE_TOKENS, LATENT // TILE), device=device, generator=generator
    )
    scales = torch.pow(2.0, exponents.float())
    rope = torch.randn(CACHE_TOKENS, ROPE, device=device, generator=generator).bfloat16()
    raw = torch.empty(CACHE_TOKENS, TOKEN_BYTES, dtype=torch.uint8, device=device)
    raw[:, :LATENT] = latent.view(torch.uint8)
    raw[:, LATENT : LATENT + 16] = scales.contiguous().view(torch.uint8)
    raw[:, LATENT + 16 :] = rope.contiguous().view(torch.uint8)
    keys = torch.cat(
        [
            (latent.float().view(-1, LATENT // TILE, TILE) * scales[..., None]).flatten(1),
            rope.float(),
        ],
        dim=1,
    )
    return raw.view(CACHE_TOKENS // PAGE, PAGE, 1, TOKEN_BYTES), keys


def fp32_attention(torch, q, indices, keys, heads):
    """out [B, heads, 512], lse [B, heads] (natural log) in FP32 over the selected keys."""
    batch, topk = indices.shape[0], indices.shape[-1]
    selected = keys.index_select(0, indices.view(-1).long()).view(batch, topk, -1)
    logits = torch.einsum("bhd,btd->bht", q[:, 0, :heads].float(), selected) * SOFTMAX_SCALE
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("bht,btd->bhd", torch.exp(logits - lse[..., None]), selected[..., :LATENT])
    return out, lse


def graph_us(torch, fn) -> float:
    """Median GPU us per call over REPLAYS replays of a CUDA graph of CALLS calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / CALLS)
    return statistics.median(times)


def measure(torch, op, cache, keys, shape, generator) -> dict:
    batch, heads, topk = shape
    padded = padded_heads(heads)
    q = torch.zeros(batch, 1, padded, 576, dtype=torch.bfloat16, device="cuda")
    q[:, :, :heads] = torch.randn(batch, 1, heads, 576, device="cuda", generator=generator)
    noise = torch.rand(batch, CACHE_TOKENS, device="cuda", generator=generator)
    indices = noise.topk(topk, dim=-1).indices.int().view(batch, 1, topk)

    def call(metadata=None, splits=None):
        return op(
            q,
            cache,
            indices,
            None,
            None,
            metadata,
            splits,
            None,
            None,
            None,
            LATENT,
            SOFTMAX_SCALE,
            None,
        )

    out, lse, metadata, splits = call()
    want, want_lse = fp32_attention(torch, q, indices, keys, heads)
    out_error = (out[:, 0, :heads].float() - want).abs().max().item()
    lse_error = (lse[:, :heads, 0].float() - want_lse).abs().max().item()
    scale = want.abs().max().item()
    ok = out_error <= 2e-2 * scale + 2e-3 and lse_error <= 1e-2  # BF16 query and output
    result = dict(
        batch=batch,
        heads=heads,
        padded_heads=padded,
        keys=topk,
        ok=ok,
        out_error=out_error,
        out_max=scale,
        lse_error=lse_error,
    )
    if ok:
        us = graph_us(torch, lambda: call(metadata, splits))
        result.update(us=us, tflops=2.0 * batch * padded * topk * (576 + LATENT) / us / 1e6)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--library", required=True, help="FlashMLA's compiled extension (_flashmla_C.abi3.so)"
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=None,
        help="B,H,keys per shape (default: " + " ".join(SHAPES) + ")",
    )
    parser.add_argument("--out", help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    shapes = args.shapes or [parse_shape(s) for s in SHAPES]
    try:
        import torch
    except ImportError:
        print(
            "peer_flashmla needs PyTorch with CUDA (not a dependency of this package)",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("peer_flashmla needs a CUDA GPU (FlashMLA's SM90 kernels)", file=sys.stderr)
        return 2
    try:
        torch.ops.load_library(args.library)
        op = torch.ops._flashmla_C.sparse_decode_fwd
    except (OSError, RuntimeError, AttributeError) as error:
        print(
            f"--library {args.library}: no FlashMLA sparse decode there ({error})", file=sys.stderr
        )
        return 2
    generator = torch.Generator(device="cuda")
    generator.manual_seed(0)
    cache, keys = build_cache(torch, generator)
    device = torch.cuda.get_device_name()
    print(f"FlashMLA sparse_decode_fwd from {args.library}; {device}, torch {torch.__version__}")
    results = []
    for shape in shapes:
        r = measure(torch, op, cache, keys, shape, generator)
        results.append(r)
        check = (
            f"out error {r['out_error']:.2e} of max {r['out_max']:.2e}, "
            f"lse error {r['lse_error']:.2e}"
        )
        pad = f" (padded to {r['padded_heads']})" if r["padded_heads"] != r["heads"] else ""
        timing = f"{r['us']:.2f} us  {r['tflops']:.0f} TFLOP/s" if r["ok"] else "CHECK FAILED"
        print(
            f"B={r['batch']} H={r['heads']}{pad} keys={r['keys']}: {timing}  ({check})", flush=True
        )
    print(f"Method: CUDA graph of {CALLS} calls, median of {REPLAYS} replays; metadata reused.")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, results=results), f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
