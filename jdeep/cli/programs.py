"""The commands about a deployment's programs, built from a config alone (no weights): `jdeep info --programs` (the
serving inventory counted), `jdeep check-graph` (every program checked against Neuron's compile-safety rules) and
`jdeep export` (the programs written as StableHLO with a manifest), each `cmd_<name>(args) -> exit code`."""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax

from ..config import ModelConfig
from ..config.presets import preset
from ..platforms import compile_mode, platform_for
from ..runtime.inventory import plan_inventory
from ..runtime.runner import SAMPLER_KINDS
from ..speculative.inventory import plan_speculative_inventory
from ..tools.dev.export import export_programs, model_info
from ..tools.dev.graphcheck import Limits, check_lowered
from ..tools.dev.inventory_report import count_inventory, format_inventory
from ..tools.dev.programs import Target, chunk_buckets, inventory_programs, model_programs, speculative_programs
from ..tools.dev.vision_programs import vision_programs
from .args import batch_sizes, np_dtype

__all__ = ["info_programs", "cmd_check_graph", "cmd_export"]


def info_programs(args: argparse.Namespace) -> int:
    """jdeep info --programs: the serving inventory counted (tools/dev/inventory_report.py)."""
    if args.mesh is not None:
        raise ValueError("--programs counts one device's programs; leave out --mesh")
    config = preset(args.preset) if args.preset else ModelConfig.from_file(args.model)
    platform = args.platform or jax.default_backend()
    mode = compile_mode(args.mode, platform_for(platform))
    t = Target.for_config(config, np_dtype(args.dtype), mode, fp8_max=platform_for(platform).fp8_max,
                          packed_params=mode == "scan" and platform == "neuron", platform=platform)
    try:
        counted = count_inventory(t, args.max_num_seqs, args.max_len or 4096, args.prefill_chunk,
                                  args.max_num_batched_tokens, args.prefix_cache_bytes != 0, args.speculative_tokens,
                                  args.batch_buckets, args.chunk_buckets, args.prefill_batch_buckets, platform)
    except ValueError as e:
        raise SystemExit(f"jdeep info --programs: {e}") from None
    print(format_inventory(counted))
    return 0


def _graph_target(args: argparse.Namespace) -> Target:
    """What check-graph and export build programs for: a preset or a checkpoint's config.json (no weights)."""
    config = preset(args.preset) if args.preset else ModelConfig.from_file(args.model)
    target = Target.for_config(config, np_dtype(args.dtype), args.mode, args.host_embedding,
                               args.quantize_activations, args.fp8_max, args.packed_kv,
                               packed_params=args.mode == "scan" and not args.no_pack_params, platform=args.platform)
    # without jdeep's native CPU products: they are a custom call of this process (an exported program runs where it
    # is not registered) and no rule of check-graph's, which are Neuron's, admits them
    return dataclasses.replace(target, numerics=target.numerics.portable())


def _deployment_programs(args: argparse.Namespace, target: Target) -> list:
    """With --max-num-seqs: the engine's inventory for the serve settings (runtime/inventory.plan_inventory; with
    --speculative-tokens the MTP or DSpark engine's, speculative/inventory.plan_speculative_inventory), lowered under
    its names (tools/dev/programs.inventory_programs)."""
    prefix_cache = args.prefix_cache_bytes != 0
    if args.speculative_tokens is None:
        specs, n_slots, state_len = plan_inventory(target.config, args.max_num_seqs, args.max_len,
                                                   args.prefill_chunk, args.max_num_batched_tokens,
                                                   prefix_cache=prefix_cache, batch_buckets=args.batch_buckets,
                                                   chunk_buckets=args.chunk_buckets,
                                                   prefill_batch_buckets=args.prefill_batch_buckets,
                                                   platform=args.platform)
        return inventory_programs(target, specs, n_slots, state_len)
    method = "dspark" if target.config.dspark is not None else "mtp"
    try:
        specs, n_slots, state_len, drafter = plan_speculative_inventory(
            target, method, args.speculative_tokens, args.max_num_seqs, args.max_len, args.prefill_chunk,
            args.max_num_batched_tokens, prefix_cache, args.batch_buckets, args.chunk_buckets,
            args.prefill_batch_buckets, args.platform)
        return inventory_programs(drafter.spec, specs, n_slots, state_len, drafter=drafter)
    except ValueError as e:
        raise SystemExit(f"jdeep: --speculative-tokens {args.speculative_tokens}: {e}") from None


def cmd_check_graph(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    target = _graph_target(args)
    limits = Limits(max_args=args.max_args)
    failed = 0
    if args.max_num_seqs is not None:
        programs = _deployment_programs(args, target)
    else:
        programs = model_programs(target, batch_sizes(args.batch_sizes), chunk_buckets(args.prefill_len),
                                  args.max_len, max_prefill_tokens=args.max_prefill_tokens)
        if args.speculative_tokens is not None:
            programs += speculative_programs(target, batch_sizes(args.batch_sizes), args.speculative_tokens,
                                             chunk_buckets(args.prefill_len), args.max_len)
        programs += vision_programs(target, batch_sizes(args.batch_sizes), chunk_buckets(args.prefill_len),
                                    args.max_len, args.max_prefill_tokens)
    # on Neuron the sampler and its penalty rows run on the host's CPU backend (Model.sampler_device): they are XLA:CPU
    # programs, not neuronx-cc ones, and Neuron's rules do not apply to them
    host = [p for p in programs if args.platform == "neuron" and p.bucket.get("step") in SAMPLER_KINDS]
    for prog in programs:
        if prog in host:
            print(f"host  {prog.name}  (the host CPU backend samples on Neuron: not a Neuron program)")
            continue
        report = check_lowered(prog.lower(), name=prog.name, n_experts=target.config.n_routed_experts,
                               decode=prog.bucket["step"] == "decode", limits=limits)
        failed += not report.ok
        if args.verbose or not report.ok:
            print(report.format())
        else:
            print(f"ok    {prog.name}  ({report.stats.get('n_args')} args, {report.stats.get('n_ops')} ops)")
    checked = len(programs) - len(host)
    print(f"{checked - failed}/{checked} programs pass the compile-safety rules "
          f"({args.mode} mode, {args.dtype}, fp8 max {args.fp8_max:g}; {time.perf_counter() - t0:.0f} s)"
          + (f"; {len(host)} host programs (the sampler's) not checked" if host else ""))
    return 1 if failed else 0


def cmd_export(args: argparse.Namespace) -> int:
    target = _graph_target(args)
    if args.max_num_seqs is not None:
        manifest = export_programs(_deployment_programs(args, target), args.out, model_info(target))
        print(f"wrote {len(manifest['programs'])} programs and manifest.json to {args.out}")
        return 0
    programs = model_programs(target, batch_sizes(args.batch_sizes), args.prefill_len, args.max_len)
    if args.speculative_tokens is not None:
        programs += speculative_programs(target, batch_sizes(args.batch_sizes), args.speculative_tokens,
                                         (args.prefill_len,), args.max_len)
    manifest = export_programs(programs, args.out, model_info(target))
    print(f"wrote {len(manifest['programs'])} programs and manifest.json to {args.out}")
    return 0
