"""Benchmark: delta weight versions vs full versions — bytes per update, pull time, publish cost.

Three parts, all measured in this run:

(a) ``demo``: the default demo (``configs/local.toml``, real GRPO steps of the tiny Llama, real local rollout
    workers) with deltas on; from its report: the full version's bytes, the mean bytes a puller holding v−1
    receives per update, and the bytes all instances actually received. Then the two newest checkpoints'
    policies (consecutive steps) cast to bf16 compare the encodings: zstd of the byte planes of the 16-bit
    differences offset by 128 (what ships), XOR + zstd on byte planes (what shipped before), XOR + zstd without
    the split, (position, value) pairs. ``--model-dir`` runs the same task with a Hugging Face model directory
    instead (``--tiny-qwen3``: the tests' random tiny Qwen3, made here), ``--demo-lrs`` at several learning
    rates: a bf16 element changes when Adam's fp32 master (moved by about ``lr`` per step) crosses a rounding
    boundary, whose spacing is 2^-8 of the weight's magnitude — the fraction that changes grows with
    ``lr / |w|``.
(b) ``synthetic``: a model of ``--size-mib`` bf16 bytes with fp32 master weights moved each step by an
    Adam-like update (every element by ``lr`` in a random direction; bf16 elements change only where the
    master crosses a rounding boundary — the mechanism that makes RL deltas sparse), at ``--lrs``; per lr the
    fraction of changed bf16 elements, delta ÷ full bytes, the publish's seconds (copy + checksums) and its
    delta encoding seconds (the trainer-side cost of deltas, same call), and pull seconds of a delta pull ÷ a
    full pull into a reused buffer, on loopback (the wire costs nearly nothing here: this is the CPU cost).
(c) host memory: what a rollout instance keeps for its base copy (one version in the wire dtype).

Run: ``.venv/bin/python benchmarks/bench_delta.py [--size-mib 256] [--lrs 1e-6 3e-5] [--reps 3] [--skip-demo]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlboost_hpc.weights import WeightPuller, WeightServer  # noqa: E402
from rlboost_hpc.weights import delta as delta_codec  # noqa: E402
from rlboost_hpc.models import layout  # noqa: E402


def encodings(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Sizes of the encodings of b against a (bf16 tensors of equal shape) as fractions of b's bytes."""
    A, B = a.view(torch.int16).numpy(), b.view(torch.int16).numpy()
    n = B.nbytes
    x = np.bitwise_xor(A, B).view(np.uint8)
    shipped = delta_codec.encode_chunk(memoryview(B.view(np.uint8)), memoryview(A.view(np.uint8)))
    xor_planes = np.concatenate([x[0::2], x[1::2]])
    zstd1 = zstandard.ZstdCompressor(level=delta_codec.ZSTD_LEVEL)
    _, counts = np.unique(B.view(np.uint16) - A.view(np.uint16), return_counts=True)
    prob = counts / counts.sum()
    return {"changed_elements": float((A != B).mean()),
            "entropy": float(-(prob * np.log2(prob)).sum()) * A.size / 8 / n,
            "diff_planes": (len(shipped) if shipped else 0) / n,
            "xor_planes": len(zstd1.compress(xor_planes.tobytes())) / n,
            "xor_zstd": len(zstd1.compress(x.tobytes())) / n,
            "positions_values": int((A != B).sum()) * 6 / n}


def demo(steps: int, model_dir: Path | None, lr: float | None) -> None:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "demo"
        cmd = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(ROOT / "configs/local.toml"),
               "--out", str(out), "--set", f"trainer.steps={steps}", "--no-progress"]
        if model_dir is not None:
            cmd += ["--set", f"model.path='{model_dir}'"]
        if lr is not None:
            cmd += ["--set", f"trainer.lr={lr}"]
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        r = json.loads((out / "report.json").read_text())
        model = model_dir.name if model_dir is not None else "stories260K"
        print(f"(a) demo, {model}, lr {lr if lr is not None else 'of the config'}: {r['steps']} GRPO steps "
              f"({time.monotonic() - t0:.0f} s), greedy held-out reward {r['reward_heldout_greedy_before']:.2f} -> "
              f"{r['reward_heldout_greedy_after']:.2f}; full version "
              f"{r['weight_bytes']} B; mean update for a holder of v-1 {r['weight_update_bytes_mean']:.0f} B = "
              f"{r['weight_update_bytes_mean'] / r['weight_bytes']:.4f} of full (1/{r['weight_bytes'] / max(1, r['weight_update_bytes_mean']):.1f}); "
              f"{r['weight_pulls']} pulls received {r['weight_pulled_bytes']} B in all "
              f"({r['weight_pulled_bytes'] / max(1, r['weight_pulls']) / r['weight_bytes']:.4f} of full per pull, "
              f"first pulls full); checksum mismatches {r['weight_checksum_mismatches']}")
        per_step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        ratios = [m["weight_update_bytes"] / m["weight_bytes"] for m in per_step]
        print(f"    per step delta/full: first {ratios[0]:.4f}, median {statistics.median(ratios):.4f}, "
              f"last {ratios[-1]:.4f}, max {max(ratios):.4f}")
        ck = sorted((out / "checkpoints").glob("step-*"))
        if len(ck) >= 2:
            a, b = (torch.load(c / "backend" / "torch_backend.pt", weights_only=True)["model"] for c in ck[-2:])
            keys = sorted(k for k in a if a[k].is_floating_point())
            flat = [torch.cat([sd[k].to(torch.bfloat16).flatten() for k in keys]) for sd in (a, b)]
            e = encodings(*flat)
            print(f"    encodings of {ck[-1].name} against {ck[-2].name}: changed bf16 elements "
                  f"{e['changed_elements']:.4f}; offset difference byte planes + zstd (shipped) "
                  f"{e['diff_planes']:.4f}, XOR byte planes + zstd {e['xor_planes']:.4f}, XOR + zstd "
                  f"{e['xor_zstd']:.4f}, (position, value) pairs {e['positions_values']:.4f} of full; order-0 entropy "
                  f"of the 16-bit differences {e['entropy']:.4f} (what a coder of independent elements cannot beat)")


def xor_encode_chunk(new: np.ndarray, base: np.ndarray) -> bytes:
    """The previous codec (ablation): zstd of the byte planes of ``new XOR base`` (uint8 arrays, even length)."""
    x = np.bitwise_xor(new, base)
    return zstandard.ZstdCompressor(level=delta_codec.ZSTD_LEVEL).compress(np.concatenate([x[0::2], x[1::2]]).data)


def xor_apply_chunk(dest: np.ndarray, payload: bytes) -> None:
    planes = np.frombuffer(zstandard.ZstdDecompressor().decompress(payload), dtype=np.uint8)
    h = dest.size // 2
    x16 = planes[h:].astype("<u2")
    x16 <<= 8
    x16 |= planes[:h]
    dest.view("<u2")[:] ^= x16


def codec_ablation(base: torch.Tensor, new: torch.Tensor, chunk_bytes: int, reps: int = 5) -> str:
    """Shipped codec vs XOR planes on one tensor pair (bf16), chunk by chunk on one thread: bytes, and GB/s of
    the median of ``reps`` interleaved repetitions."""
    a, b = base.view(torch.uint8).numpy(), new.view(torch.uint8).numpy()
    spans = [(lo, min(a.size, lo + chunk_bytes)) for lo in range(0, a.size, chunk_bytes)]
    codecs = {"offset difference": (lambda n, o: delta_codec.encode_chunk(memoryview(n), memoryview(o)),
                                    lambda d, p: delta_codec.apply_chunk(memoryview(d), p)),
              "XOR (before)": (xor_encode_chunk, xor_apply_chunk)}
    enc_s: dict[str, list[float]] = {k: [] for k in codecs}
    app_s: dict[str, list[float]] = {k: [] for k in codecs}
    size = {}
    for _ in range(reps):
        for name, (enc, app) in codecs.items():
            t0 = time.perf_counter()
            payloads = [enc(b[lo:hi], a[lo:hi]) for lo, hi in spans]
            t1 = time.perf_counter()
            dest = a.copy()
            t2 = time.perf_counter()
            for (lo, hi), pl in zip(spans, payloads):
                if pl is not None:
                    app(dest[lo:hi], pl)
            t3 = time.perf_counter()
            assert np.array_equal(dest, b)
            enc_s[name].append(t1 - t0)
            app_s[name].append(t3 - t2)
            size[name] = sum(len(pl) for pl in payloads if pl is not None)
    return "; ".join(f"{k} {size[k] / a.size:.4f} of full, encode {a.size / statistics.median(enc_s[k]) / 1e9:.2f} "
                     f"GB/s, apply {a.size / statistics.median(app_s[k]) / 1e9:.2f} GB/s" for k in codecs)


def synthetic(size_mib: int, lrs: list[float], reps: int, chunk_mib: int, warmup: int = 3) -> None:
    n_el = size_mib * (1 << 20) // 2
    shapes = [(n_el // 8,)] * 8
    g = torch.Generator().manual_seed(0)
    print(f"(b) synthetic {size_mib} MiB bf16 ({n_el / 1e6:.0f} M parameters, fp32 master as the torch backend's "
          f"FlatState), chunks {chunk_mib} MiB, {warmup} warm-up + {reps} steps per lr, medians")
    cb = chunk_mib << 20
    for lr in lrs:
        master = layout.FlatState.pack({f"w{i}": torch.randn(s, generator=g) * 0.02 for i, s in enumerate(shapes)},
                                       torch.bfloat16)
        rows: dict[str, list[float]] = {k: [] for k in ("changed", "ratio", "pub_full", "pub_delta", "pub_serial",
                                                         "delta_wait", "serial_wait", "pull_full", "pull_delta")}
        with WeightServer(chunk_bytes=cb, delta=False, copy_threads=1) as full_srv, \
                WeightServer(chunk_bytes=cb, delta=True, copy_threads=1) as delta_srv, \
                WeightServer(chunk_bytes=cb, delta=True, copy_threads=1) as serial_srv:
            serial_srv.store._delta_overlap = False  # ablation: every chunk's delta encoded after the last is hashed
            for srv in (full_srv, delta_srv, serial_srv):
                srv.publish(0, master)
            puller_f, puller_d = WeightPuller(full_srv.endpoint, streams=2), WeightPuller(delta_srv.endpoint, streams=2)
            staging = puller_f.pull(0).buffer
            held = puller_d.pull(0)
            prev = held.state_dict["w0"].clone()
            ablation = ""
            for v in range(1, warmup + reps + 1):
                master.flat.add_(torch.randn(master.flat.shape, generator=g).sign_() * lr)
                waits = {}
                times = {}
                for key, srv in (("pub_full", full_srv), ("pub_delta", delta_srv), ("pub_serial", serial_srv)):
                    w0 = srv.stats["delta_seconds"]
                    t = time.perf_counter()
                    srv.publish(v, master)
                    times[key] = time.perf_counter() - t
                    waits[key] = srv.stats["delta_seconds"] - w0
                t2 = time.perf_counter()
                got_f = puller_f.pull(v, into=staging)
                t3 = time.perf_counter()
                held = puller_d.pull(v, base=held)
                t4 = time.perf_counter()
                assert held.checksum == got_f.checksum
                cur = held.state_dict["w0"]
                if v == warmup + reps:
                    ablation = codec_ablation(prev, cur, cb)
                if v > warmup:
                    rows["changed"].append(float((cur.view(torch.int16) != prev.view(torch.int16)).float().mean()))
                    d = delta_srv.delta_nbytes(v)
                    rows["ratio"].append((d if d is not None else held.nbytes) / held.nbytes)
                    for key, t in times.items():
                        rows[key].append(t)
                    rows["delta_wait"].append(waits["pub_delta"])
                    rows["serial_wait"].append(waits["pub_serial"])
                    rows["pull_full"].append(t3 - t2)
                    rows["pull_delta"].append(t4 - t3)
                prev = cur.clone()
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"    lr {lr:g}: changed bf16 elements {med['changed']:.4f}; delta/full bytes {med['ratio']:.4f} "
              f"(1/{1 / max(med['ratio'], 1e-9):.0f}); pull delta {med['pull_delta']:.3f} s vs full "
              f"{med['pull_full']:.3f} s = {med['pull_delta'] / med['pull_full']:.2f}x")
        print(f"      publish: no delta {med['pub_full']:.3f} s (cast + checksums); with the delta encoded chunk by "
              f"chunk as each is hashed {med['pub_delta']:.3f} s (waited {med['delta_wait']:.3f} s for it) vs encoded "
              f"after the last chunk {med['pub_serial']:.3f} s (encoding {med['serial_wait']:.3f} s = "
              f"{size_mib / 1024 / med['serial_wait']:.2f} GiB/s on {delta_srv.store._delta_threads} threads): the delta "
              f"adds {med['pub_delta'] - med['pub_full']:.3f} s vs {med['pub_serial'] - med['pub_full']:.3f} s")
        print(f"      codecs on w0 ({size_mib // 8} MiB) of the last step, 1 thread: {ablation}")
    print(f"(c) base copy kept per rollout instance: one version in the wire dtype = {size_mib} MiB here "
          f"(2 bytes per parameter in bf16: 16 GB for an 8B model); while a delta is applied nothing more "
          f"(in place; per stream one chunk of {chunk_mib} MiB)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--chunk-mib", type=int, default=1)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-5])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--demo-steps", type=int, default=60)
    p.add_argument("--demo-lrs", type=float, nargs="+", default=[None],
                   help="learning rates of the demo part (default: the config's)")
    p.add_argument("--model-dir", type=Path, default=None, help="a Hugging Face model directory for the demo part")
    p.add_argument("--tiny-qwen3", action="store_true",
                   help="the demo part with the tests' random tiny Qwen3 (vocabulary 512, hidden 64), made here")
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--skip-synthetic", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        model_dir = a.model_dir
        if a.tiny_qwen3:
            sys.path.insert(0, str(ROOT / "tests"))
            from _models import make_model_dir  # the tests' checkpoint maker (a dev tool, not the product)
            model_dir = make_model_dir(Path(d) / "tiny-qwen3", "qwen3", tied=False)
        for lr in [] if a.skip_demo else a.demo_lrs:
            demo(a.demo_steps, model_dir, lr)
    if not a.skip_synthetic:
        synthetic(a.size_mib, a.lrs, a.reps, a.chunk_mib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
