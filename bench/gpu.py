"""One-call GPU check: exactness on CUDA, and the costs that set FlashMap's speedup.

  python bench/gpu.py --out DIR     (or python -m bench.gpu; on the GPU machine, guarded at --budget s)
  python bench/gpu.py --smoke       (tiny shapes on the CPU: the script's own test)
  python -m bench.gpu --only training --out DIR   (the training step alone, ~3 min on an H200)

Sections (each in its own try/except, so one failure keeps the others' numbers; skipped
when the time guard says they would not fit):
  env          device, versions, SM count
  ceilings     device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate,
               on random data (bench.gpu_target)
  exactness    tiny random Qwen3 (4 layers), fp32 and bf16: CUDA-graph engine == eager
               engine on mixed batches (prefill beside verify rows, rollback, slot reuse,
               sampling rows); speculative == autoregressive at T=0 (untrained FlashMap
               drafter, its CUDA graphs); batch-invariant mode: a 17-token verify and 17
               one-token steps bit-identical, and speculative == autoregressive token for
               token (bench.gpu_exactness)
  target       Qwen3-8B shape (36 layers, hidden 4096, GQA 32/8, head_dim 128, intermediate
               12288, V = 151,936), random bf16 weights, context 512: memory floor (weight
               bytes / copy bandwidth); step (1 token) and verify (17 tokens) at batch
               1/4/16, eager and CUDA graphs, end to end (engine.verify, host clock) and
               replay only (CUDA events); the GEMMs alone in a graph; each fused op x 36
               layers (bench.gpu_target)
  drafter      paper size (dim 2048, 6 blocks, 16 heads), bf16, noise on the device: 1 and 2
               jumps at batch 1/4/16, eager and CUDA graphs (bench.gpu_drafter)
  cuda_tests   the repository's CUDA tests (pytest -k cuda), in a subprocess
  training     only when named (--only training; always with --smoke): one drafter training
               step, paper-size drafter + Qwen3-8B-shape target computing the features online,
               at batch 256 on one GPU and at 8 GPUs' per-GPU share: memory and time, and the
               paper's 39K + 23K steps estimated from them (bench.gpu_training)
  projection   speedup gamma * t_step / (t_verify + t_draft) for gamma = 3..6

Full numbers go to DIR/gpu_check.json (rewritten after every section) and the log to
DIR/gpu_check.log; a short table with the acceptance checks is printed LAST. The current
report of a run on a lent H200 is docs/results/gpu_h200.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench import gpu_timing  # noqa: E402
from bench.gpu_drafter import drafter_section  # noqa: E402
from bench.gpu_exactness import exactness_section  # noqa: E402
from bench.gpu_target import ceilings_section, target_section  # noqa: E402
from bench.gpu_timing import BATCHES, LOG, T0, Guard, say, watchdog  # noqa: E402
from bench.gpu_training import training_section, training_summary  # noqa: E402

# ----------------------------------------------------------------------------- sections


def env_section(dev) -> dict:
    out = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(dev)}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        out["triton"] = f"unavailable ({type(e).__name__})"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        out.update(
            name=p.name,
            sms=p.multi_processor_count,
            memory_gb=round(p.total_memory / 1e9, 1),
            capability=f"{p.major}.{p.minor}",
        )
    return out


def cuda_tests_section(guard: Guard) -> dict:
    """The repository's CUDA tests (they skip on a CPU): graph == eager and lossless with graphs
    on CUDA, the drafter's device noise. In a subprocess, bounded by the time guard."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    limit = max(30.0, min(240.0, guard.left() - 20))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "cuda",
        "tests/test_target_graphs.py",
        "tests/test_drafter_device_noise.py",
    ]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=limit)
        out = {"returncode": p.returncode, "tail": (p.stdout + p.stderr)[-2500:]}
    except subprocess.TimeoutExpired as e:
        out = {
            "returncode": None,
            "error": f"timed out after {limit:.0f} s",
            "tail": (
                (e.stdout or b"").decode(errors="replace")
                if isinstance(e.stdout, bytes)
                else (e.stdout or "")
            )[-2500:],
        }
    out["seconds"] = round(time.perf_counter() - t, 1)
    last = [l for l in out["tail"].splitlines() if l.strip()]
    out["result"] = last[-1] if last else ""
    return out


def projection(report: dict) -> dict:
    t, d = report.get("target", {}), report.get("drafter", {}).get("latency", {})
    lat = t.get("graph") or t.get("eager") or {}
    out = {}
    for b in BATCHES:
        if f"step b={b}" not in lat or f"verify17 b={b}" not in lat:
            continue
        step, ver = lat[f"step b={b}"]["ms"], lat[f"verify17 b={b}"]["ms"]
        for steps in (1, 2):
            dr = d.get(f"graph steps={steps} b={b}") or d.get(f"eager steps={steps} b={b}")
            if dr is None:
                continue
            for gamma in (3, 4, 5, 6):
                out[f"b={b} steps={steps} gamma={gamma}"] = round(
                    gamma * step / (ver + dr["ms"]), 2
                )
    return out


def summary(report: dict) -> list[str]:
    """The short table printed last, with the issue's acceptance checks."""
    lines = ["", "=" * 78, "GPU CHECK SUMMARY"]
    env, ceil, t, d = (report.get(k, {}) for k in ("env", "ceilings", "target", "drafter"))
    lines.append(
        f"device {env.get('name', env.get('device'))}  torch {env.get('torch')}  triton {env.get('triton')}  "
        f"copy {ceil.get('copy_GBps')} GB/s  bf16 mm {ceil.get('matmul_TFLOPs')} TFLOP/s"
    )
    for dt in ("fp32", "bf16"):
        e = report.get(f"exactness_{dt}")
        if e is None:
            continue
        if "error" in e:
            lines.append(f"exact {dt}: ERROR {e['error'][:120]}")
            continue
        ge = e.get("graph_vs_eager", {})
        inv = e.get("invariant_verify17_vs_17_steps", {})
        lines.append(
            f"exact {dt}: graph==eager argmax {ge.get('argmax_equal')} feat err {ge.get('features_max_rel_err', 0):.1e}"
            f" | spec==AR s1 {e.get('speculative_eq_autoregressive_steps1')} s2 "
            f"{e.get('speculative_eq_autoregressive_steps2')} | invariant bitwise {inv.get('features_bitwise_equal')}"
            f" spec==AR {e.get('invariant_speculative_eq_autoregressive')} | ops {e.get('ops')}"
        )
    floor = t.get("floor_ms")
    g, ea, rp = t.get("graph", {}), t.get("eager", {}), t.get("replay_device_ms", {})
    if floor or g:
        lines.append(
            f"target 8B bf16 ctx {t.get('context')}: weights {t.get('weight_bytes', 0) / 1e9:.2f} GB, "
            f"floor {floor} ms, ops {t.get('ops')}, graph vs eager {t.get('graph_vs_eager_b4_verify17')}"
        )
        lines.append(
            f"{'batch':>5} | {'step graph':>10} {'replay':>7} {'eager':>7} | {'verify17 g':>10} {'replay':>7} "
            f"{'eager':>7} | {'T=1,S=4':>7} | {'decode8/8':>9} | step/floor  v/step"
        )
        for b in BATCHES:
            st, vr = g.get(f"step b={b}", {}).get("ms"), g.get(f"verify17 b={b}", {}).get("ms")
            f = lambda v: f"{v:7.2f}" if isinstance(v, (int, float)) else f"{'-':>7}"  # noqa: E731
            ratio = f"{st / floor:10.2f}" if st and floor else f"{'-':>10}"
            vs = f"{vr / st:7.2f}" if st and vr else f"{'-':>7}"
            lines.append(
                f"{b:>5} | {f(st):>10} {f(rp.get(f'b={b} q=1'))} {f(ea.get(f'step b={b}', {}).get('ms'))} | "
                f"{f(vr):>10} {f(rp.get(f'b={b} q=17'))} {f(ea.get(f'verify17 b={b}', {}).get('ms'))} | "
                f"{f(g.get(f'verify17_T1_S4 b={b}', {}).get('ms'))} | "
                f"{f((g.get(f'decode8 b={b}', {}).get('ms') or float('nan')) / 8):>9} | {ratio}  {vs}"
            )
    for key, parts in (t.get("parts") or {}).items():
        if isinstance(parts, dict) and "error" not in parts:
            lines.append(
                f"parts {key} (ms/step, each in a graph): "
                + "  ".join(
                    f"{k.replace('attention ', 'attn')}={v:.3f}"
                    if isinstance(v, float)
                    else f"{k}={v}"
                    for k, v in parts.items()
                )
            )
    lat = d.get("latency", {})
    if lat:
        lines.append(
            "drafter paper size bf16 (ms, wall): "
            + "  ".join(
                f"{m[0]}{s} b={b}: {lat.get(f'{m} steps={s} b={b}', {}).get('ms', float('nan')):.2f}"
                for m in ("graph",)
                for s in (1, 2)
                for b in BATCHES
            )
        )
        lines.append(
            "drafter eager (ms): "
            + "  ".join(
                f"s{s} b={b}: {lat.get(f'eager steps={s} b={b}', {}).get('ms', float('nan')):.2f}"
                for s in (1, 2)
                for b in BATCHES
            )
        )
    proj = report.get("projection", {})
    if proj:
        lines.append(
            "projected speedup b=1 steps=1, gamma 3/4/5/6: "
            + " / ".join(str(proj.get(f"b=1 steps=1 gamma={gm}")) for gm in (3, 4, 5, 6))
            + "   b=16: "
            + " / ".join(str(proj.get(f"b=16 steps=1 gamma={gm}")) for gm in (3, 4, 5, 6))
        )
    checks = []
    st1, v1 = g.get("step b=1", {}).get("ms"), g.get("verify17 b=1", {}).get("ms")
    if st1 and floor:
        checks.append(
            f"step b=1 {st1:.2f} ms <= 1.3 x floor {1.3 * floor:.2f}: {'PASS' if st1 <= 1.3 * floor else 'FAIL'}"
            f" (replay {rp.get('b=1 q=1')})"
        )
    if st1 and v1:
        checks.append(
            f"verify17 b=1 / step = {v1 / st1:.3f} <= 1.15: {'PASS' if v1 <= 1.15 * st1 else 'FAIL'}"
        )
    d1, d16 = (
        lat.get("graph steps=1 b=1", {}).get("ms"),
        lat.get("graph steps=1 b=16", {}).get("ms"),
    )
    if d1:
        checks.append(f"drafter 1 jump b=1 {d1:.3f} ms < 1.5: {'PASS' if d1 < 1.5 else 'FAIL'}")
    if d1 and d16:
        checks.append(
            f"drafter b=16 / b=1 = {d16 / d1:.2f} < 2: {'PASS' if d16 < 2 * d1 else 'FAIL'}"
        )
    lines += training_summary(report)
    lines += ["acceptance: " + c for c in checks]
    ct = report.get("cuda_tests", {})
    if ct:
        lines.append(
            f"CUDA tests (pytest -k cuda): {ct.get('result') or ct.get('error')} ({ct.get('seconds')} s)"
        )
    errs = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
    lines.append(f"sections with errors: {errs or 'none'}; total {time.perf_counter() - T0:.0f} s")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    gpu_timing.add_options(ap, "gpu_check.json and gpu_check.log", 400.0, "sections")
    ap.add_argument(
        "--only", default="", help="comma-separated: run these sections alone (and env)"
    )
    ap.add_argument("--train-len", type=int, default=2048, help="training: tokens per sequence")
    a = ap.parse_args(argv)
    dev = gpu_timing.device_for(a, "bench/gpu.py")
    if dev is None:
        return 2
    guard = Guard(a.budget)
    skip = set(filter(None, a.skip.split(",")))
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:]}

    def save():
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
            (a.out / "gpu_check.log").write_text("\n".join(LOG) + "\n")

    def on_watchdog():  # a section that hangs must not lose the table
        report["watchdog"] = {"error": "a section was still running at the watchdog"}
        lines = summary(report)
        report["summary"] = lines
        LOG.extend(lines)
        try:
            save()
        finally:
            print("\n".join(lines), flush=True)

    timer = watchdog(a.budget + 45, on_watchdog)
    sections = [
        ("env", 5, lambda: env_section(dev)),
        ("ceilings", 20, lambda: ceilings_section(dev, a.smoke)),
        ("exactness_fp32", 60, lambda: exactness_section(dev, torch.float32, a.smoke, guard)),
        ("exactness_bf16", 60, lambda: exactness_section(dev, torch.bfloat16, a.smoke, guard)),
        ("target", 90, lambda: target_section(dev, a.smoke, guard, report)),
        ("drafter", 40, lambda: drafter_section(dev, a.smoke, guard)),
        ("cuda_tests", 60, lambda: cuda_tests_section(guard)),
        ("training", 60, lambda: training_section(dev, a.smoke, guard, a.train_len)),
    ]
    only = set(filter(None, a.only.split(",")))
    for name, need, fn in sections:
        if name in skip or (name == "cuda_tests" and a.smoke):
            continue
        if (only and name not in only | {"env"}) or (
            name == "training" and not only and not a.smoke
        ):
            continue
        if not guard.fits(need if not a.smoke else 1):
            report[name] = {"error": f"skipped: {guard.left():.0f} s left, section needs ~{need} s"}
            say(f"{name}: skipped (time guard)")
            continue
        say(f"{name} ...")
        try:
            report[name] = fn()
            say(f"{name} done")
        except Exception as e:  # noqa: BLE001 - keep the other sections' numbers
            report[name] = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
            say(f"{name} FAILED: {report[name]['error']}")
            print(report[name]["traceback"], flush=True)
        finally:
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        save()
    try:
        report["projection"] = projection(report)
    except Exception as e:  # noqa: BLE001
        report["projection"] = {"error": f"{type(e).__name__}: {e}"}
    timer.cancel()
    lines = summary(report)
    report["summary"] = lines
    LOG.extend(lines)
    save()
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
