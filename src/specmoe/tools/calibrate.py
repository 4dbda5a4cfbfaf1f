"""`specmoe calibrate`: measure this machine and save it as a hardware profile."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..autotune.calibrate import calibrate, second_tier
from ..base.checkpoint import Checkpoint
from ..base.errors import SpecMoEError, os_failure
from ..base.paths import DEMO_MODEL_DIR, cache_dir
from ..base.units import format_rate, parse_size
from ..costmodel.hardware import builtin_profile_names, save_profile
from ..experts.kernels import choose
from ..experts.quant import expert_matrices, kernel_shape


class CalibrateError(SpecMoEError):
    """Bad input to `specmoe calibrate`: one line, exit code 2."""


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help="measure this machine and save a hardware profile",
                              description="Measure disk, memory, matmul (and, with CUDA, PCIe and GPU) rates and "
                                          "save them as a hardware profile for --hardware NAME.")
    p.add_argument("--dir", metavar="PATH", help="directory for the disk test file and the engine probe's expert "
                                                 "file (default: the specmoe cache dir; put it on the disk experts "
                                                 "live on)")
    p.add_argument("--name", default="local", help="profile name (default: local)")
    p.add_argument("--size", default="256MiB", help="disk test file size (default: 256MiB)")
    p.add_argument("--json", action="store_true", help="print the profile and measurements as JSON")
    p.add_argument("--no-engine-probe", action="store_true",
                   help="skip timing the engine on the bundled demo model (CPU-only machines; the profile then "
                        "holds raw matmul and memory rates, which overstate what a small model attains)")
    p.set_defaults(func=run_calibrate)
    return p


def run_calibrate(args) -> int:
    size = parse_size(args.size, "--size")
    if args.name in builtin_profile_names() or not args.name or "/" in args.name:
        raise CalibrateError(f"bad --name {args.name!r}: choose a name that is not a built-in profile "
                             f"({', '.join(builtin_profile_names())}) and has no '/'")
    directory = Path(args.dir) if args.dir else cache_dir() / "calibrate"
    try:
        profile, m = calibrate(args.name, directory, size, engine=not args.no_engine_probe, offload_dir=args.dir)
        path = save_profile(profile, m)
        other = second_tier(profile, m)
        other_path = save_profile(other, m)
    except OSError as e:  # the main command prints it: one line, exit status 1
        raise os_failure(e, f"cannot measure the disk in {directory}",
                         "pass --dir DIR on a writable disk with room for --size") from None
    except SpecMoEError:
        raise
    except ValueError as e:  # a measurement the fit cannot use
        raise CalibrateError(str(e)) from None
    kernels = fused_kernel_report()
    if args.json:
        print(json.dumps({"profile": profile.to_dict(), "measurements": m, "path": str(path),
                          "fused_kernels": kernels}, indent=2))
    else:
        print(f"disk read {format_rate(m['disk_sequential_bw'])} sequential ({m['disk_method']}, "
              f"{m['disk_best_chunk'] >> 20} MiB reads in order), {format_rate(m['disk_random_bw'])} random "
              f"({m['disk_random_read_bytes'] >> 20} MiB reads at random offsets, {m['disk_read_depth']} in flight)")
        print(f"host memory {format_rate(m['host_mem_bw'])}, "
              f"CPU matmul fp32 {m['host_matmul_flops_fp32'] / 1e9:.0f} GFLOP/s, "
              f"bf16 {m['host_matmul_flops_bf16'] / 1e9:.0f} GFLOP/s")
        if "h2d_pinned_bw" in m:
            print(f"{m['cuda_device']}: host->device pinned {format_rate(m['h2d_pinned_bw'])}, pageable "
                  f"{format_rate(m['h2d_pageable_bw'])}, matmul bf16 {m['gpu_matmul_flops_bf16'] / 1e12:.0f} "
                  f"TFLOP/s, memory {format_rate(m['gpu_mem_bw'])}")
        if "engine_kernel_launch_s" in m:
            print(f"engine on the demo model: {m['engine_kernel_launch_s'] * 1e6:.1f} us per operator, "
                  f"{m['engine_sequence_overhead_s'] * 1e6:.0f} us per sequence, matmul "
                  f"{m['engine_device_matmul_flops'] / 1e9:.0f} GFLOP/s attained; fit error "
                  f"{m['engine_fit_rms_rel_error']:.0%} rms over {m['engine_fit_passes']} passes"
                  + (f"; an expert fetch costs {m['engine_fetch_s'] * 1e3:.2f} ms" if "engine_fetch_s" in m else ""))
        print("torch's fused CPU kernels here: " + "; ".join(f"{k}: {v}" for k, v in kernels.items()))
        print(f"saved profile {profile.name!r} to {path}; use --hardware {profile.name}")
        print(f"saved profile {other.name!r} (experts on the {other.slow_tier} tier) to {other_path}")
    return 0


# A real-size expert (hidden 2048, 2048 wide, gated): its two matrices, N x K.
REAL_SIZE_MATRICES = ((4096, 2048), (2048, 2048))


def fused_kernel_report() -> dict[str, str]:
    """Whether torch's fused int8 and int4 CPU kernels take the demo model's draft matrices
    and a real-size expert's on this machine (kernels.py: requirements, then a self-check
    in a child process); shape class -> fused or portable, and why."""
    matrices = (*expert_matrices(Checkpoint(DEMO_MODEL_DIR).config.expert), *REAL_SIZE_MATRICES)
    shapes = [kernel_shape(bits, out, inp) for bits in (8, 4) for out, inp in matrices]
    return {s.key: c.describe() for s, c in choose(shapes, "cpu").items()}
