"""Loading a checkpoint folder (DeepSeek's safetensors or a `jdeep convert` folder) into a Model: config, plan and
numerics, the params on one device or sharded over a mesh, the Engram tables and the tokenizer."""

from __future__ import annotations

import contextlib
import os
import warnings

import jax
import numpy as np
from jax.sharding import NamedSharding
from tqdm import tqdm

from .. import kernels, platforms
from ..platforms import device_memory
from ..arenas import pack_params as pack
from ..config import ModelConfig
from ..io import checkpoint, convert
from ..io.engram_tables import EngramHost
from ..io.tokenizer import Tokenizer
from ..io.trn2_rescale import trn2_rescale
from ..numerics import Numerics
from ..param_spec import abstract_params, padded_experts
from ..plan import build_plan
from ..sharding import Layout, make_mesh
from .compile_cache import enable as enable_compile_cache
from .model import Model, as_jax_dtype
from .vision import PLACEMENTS, VisionTower
from .weights import WEIGHT_FORMATS, decode_weights, resident_bytes, to_cpu_bf16

__all__ = ["load"]


def load(path: str | os.PathLike, dtype: str = "float32", quantize_activations: bool | None = None,
         fp8_max: float | None = None, packed_kv: bool = False, progress: bool = False,
         compile_mode: str | None = None, host_embedding: bool = False, pack_params: bool | None = None,
         mesh=None, mtp: bool = False, weights: str | None = None, vision_placement: str | None = None,
         drafter: bool = False, compile_cache: bool | str | os.PathLike | None = None) -> Model:
    """Load a DeepSeek-V4 checkpoint folder (HF layout: config.json + safetensors) or a folder written
    by `jdeep convert` (Orbax).

    dtype: "float32" or "bfloat16" (activations and float weights). Quantized fp8/fp4 weights stay
    uint8 codes + ue8m0 exponent bytes and are decoded where used.
    quantize_activations: DeepSeek's numerics (fp8 activations before fp8/fp4 GEMMs, KV and indexer
    QAT); the default is True for a quantized checkpoint, False otherwise. False keeps the weights
    quantized but runs activations, KV and indexer in float (the transformers numerics).
    fp8_max: 448 (OCP e4m3fn, DeepSeek's) or 240 / 224 for Trainium2's e4m3: activations and KV are
    quantized to that range and checkpoint fp8 weights are rescaled into it at load (trn2_rescale).
    Default: the platform's (240 on trn1/trn2, else 448; jdeep/platforms.py).
    packed_kv: keep window and compressed KV as uint8 records (V4: fp8 codes, rope bytes, ue8m0 exponents;
    V4.1: fp8 window entries, fp4 compressed KV with e4m3 scales, fp4 index keys) instead of float rows;
    needs quantize_activations (the KV QAT makes the records exact).
    progress: a progress bar over the checkpoint's tensors (tqdm, on stderr).
    compile_mode: "scan" (one program per step, layers under lax.scan) or "regions" (a host loop over
    layers, each layer kind's attention and FFN halves compiled once); default $JDEEP_COMPILE_MODE, else
    the platform's (regions on Neuron, scan elsewhere).
    host_embedding: keep the token embedding table in host memory and gather the rows there; the device
    receives hidden states (same logits).
    pack_params: scan mode only: each layer kind's small per-layer tensors packed into one buffer per dtype
    (arenas.py), so a step program takes few arguments; default on for Neuron in the scan mode.
    mesh: shard the model over a device mesh: "data=2,expert=4", {"data": 2, "expert": 4} or a
    jax.sharding.Mesh with axes (data, tensor, expert) (jdeep/sharding.py). The product of the sizes must
    equal the number of devices (of all processes, after jax.distributed.initialize). Each process reads
    only the checkpoint slices its devices hold; routed experts are padded with zero experts to a multiple
    of the expert axis. Both compile modes run on the mesh, with an expert-parallel MoE.
    drafter (alias: mtp): also load the checkpoint's drafter, the `mtp.*` tensors, into params["drafter"]: DeepSeek-V4's
    MTP blocks (model-spec.md §4.7, model/mtp.py) or DeepSeek-V4.1's DSpark stages (§5.8, model/dspark.py;
    plan.dspark), what speculative decoding drafts with; otherwise their tensors are checked by name only and not
    read.
    weights: how quantized fp8/fp4 weights are kept: "codes" (uint8 codes + ue8m0 scales, decoded inside each GEMM:
    1 or 0.5 bytes per weight) or "decoded" (decoded once here into `dtype`: exact, the same logits, 4 or 2 bytes
    per weight, no decode per step); default: the platform's (kernels.weight_format: codes on Neuron, whose NKI
    GEMMs read codes, decoded on CPU and GPU unless the decoded weights would fill more than half of a device's
    memory). model/weights.py.
    vision_placement: where a DeepSeek-V4.1 checkpoint's vision tower runs (model/vision.py): "host" (the host CPU
    device; only the image rows reach the model's device) or "device"; default host on Neuron, else device. It
    becomes `model.vision` (None without a vision_config).
    The folder's tokenizer.json, if any, becomes `model.tokenizer` (text prompts and stop strings).
    compile_cache: keep compiled programs in JAX's persistent compilation cache, so that the next session's first
    calls read them instead of compiling: True (the default folder, $JDEEP_COMPILE_CACHE or ~/.cache/jdeep/jax) or
    a folder; default: leave JAX's setting as it is. Give it to the session's first jdeep.load: on CPU the cache
    needs an XLA flag set before JAX starts its backend (jdeep/model/compile_cache.py; later, a warning, and it stays off).
    On Neuron, load also sets the compiler's environment (platform.configure_neuron).
    """
    path = os.fspath(path)
    if compile_cache:
        enable_compile_cache(None if compile_cache is True else compile_cache)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint folder at {path}")
    jdtype = as_jax_dtype(dtype)
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(map(repr, WEIGHT_FORMATS))}, got {weights!r}")
    plat = platforms.current()
    mode = platforms.compile_mode(compile_mode, plat)
    if mesh is not None and (host_embedding or pack_params):
        raise ValueError("mesh= keeps the embedding on the mesh and plain parameter leaves: drop host_embedding and "
                         "pack_params")
    if plat.is_neuron:
        platforms.configure_neuron(generation=plat.generation)
    if fp8_max is None:
        fp8_max = plat.fp8_max
    mtp = mtp or drafter
    config = ModelConfig.from_file(path)
    plan = build_plan(config, mtp=mtp)
    numerics = Numerics.for_config(config, quantize_activations, fp8_max, packed_kv)
    device = jax.devices()[0]   # one placement for both sources, so both hit the same compiled programs
    layout = None
    if mesh is not None:
        layout = Layout.for_model(make_mesh(mesh), config.moe_inter_dim)
        # XLA's partitioner cannot split a custom call: it would gather the weights of every native product
        numerics = numerics.portable()
    if convert.is_converted(path) and config.engram is not None:
        raise ValueError(f"{path}: converted (Orbax) folders of models with Engram layers are not supported yet; "
                         "load the original checkpoint folder")
    if plan.dspark is not None and mesh is not None:
        raise ValueError("the DSpark stages (mtp=True on a DeepSeek-V4.1 checkpoint) do not run on a mesh yet; load "
                         "without mesh=")
    if mtp and convert.is_converted(path):
        raise ValueError(f"{path}: converted (Orbax) folders hold no MTP blocks; load the original checkpoint folder "
                         "for mtp=True")
    if layout is not None:
        params = _load_sharded(path, config, plan, jdtype, numerics, layout, progress)
    elif convert.is_converted(path):
        params = jax.device_put(convert.restore_converted(path, config, plan, jdtype), device)
    else:
        with _progress(path, progress) as report:
            params = checkpoint.load_params(path, config, plan, np.dtype(jdtype), progress=report,
                                            fp8_rescale=_rescaler(numerics), device=device)
    if weights is None:
        weights = _default_weights(params, jdtype, 1 if layout is None else layout.mesh.size)
    if weights == "decoded":
        params = decode_weights(params, numerics, jdtype, layout)
    engram = EngramHost.load(path, config.engram) if config.engram is not None else None
    tokenizer = None
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        tokenizer = Tokenizer(path)
    host_embed = None
    if host_embedding:
        # a copy: on CPU np.asarray can alias the device buffer, which is freed once the array is dropped
        host_embed = np.array(params.pop("embed"), copy=True)
    if pack_params is None:
        pack_params = plat.is_neuron and mode == "scan" and layout is None
    if (mode == "scan" and layout is None and not pack_params and np.dtype(jdtype) == jax.numpy.bfloat16
            and kernels.bf16_weights_as_bits()):
        params = to_cpu_bf16(params)
    if pack_params:
        if mode != "scan":
            raise ValueError("pack_params applies to the scan compile mode (regions programs take few arguments)")
        params = pack(params)
    sampler_device = None
    if plat.is_neuron and layout is None:   # the plugin's threefry RNG is incomplete: sample on the host CPU
        try:
            sampler_device = jax.devices("cpu")[0]
        except RuntimeError:
            warnings.warn("no CPU backend (JAX_PLATFORMS excludes cpu): sampling runs on the Neuron device, whose "
                          "threefry RNG is incomplete; set JAX_PLATFORMS=neuron,cpu")
    vision = None
    if config.vision is not None:
        if convert.is_converted(path):
            raise ValueError(f"{path}: converted (Orbax) folders hold no vision tower; load the original checkpoint")
        placement = vision_placement or ("host" if plat.is_neuron else "device")
        vision = VisionTower.load(path, config, jdtype, placement, device)
    elif vision_placement is not None and vision_placement not in PLACEMENTS:
        raise ValueError(f"vision_placement must be one of {', '.join(PLACEMENTS)}, got {vision_placement!r}")
    return Model(config, plan, params, jdtype, numerics, engram, tokenizer, compile_mode=mode, host_embed=host_embed,
                 sampler_device=sampler_device, layout=layout, vision=vision)


def _load_sharded(path: str, config, plan, jdtype, numerics, layout, progress: bool) -> dict:
    """Params as global arrays sharded by `layout`, each process reading only its devices' slices."""

    def sharding_for(tree_path: tuple, shape: tuple) -> NamedSharding:
        return NamedSharding(layout.mesh, layout.param_spec(tree_path, shape))

    n_experts = padded_experts(config.n_routed_experts, layout.sizes["expert"])
    if convert.is_converted(path):
        if n_experts != config.n_routed_experts:
            raise ValueError(f"{path}: {config.n_routed_experts} routed experts do not divide over expert="
                             f"{layout.sizes['expert']}; load the original checkpoint (it pads the experts) or pick an "
                             "expert axis that divides the expert count")
        target = abstract_params(config, plan, jdtype)
        target = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, layout.param_shardings(target))
        return convert.restore_converted(path, config, plan, jdtype, target=target)
    with _progress(path, progress and jax.process_index() == 0, f" ({layout.describe()})") as report:
        return checkpoint.load_params_sharded(path, config, plan, np.dtype(jdtype), sharding_for, n_experts,
                                              progress=report, fp8_rescale=_rescaler(numerics))


def _default_weights(params: dict, jdtype, n_devices: int) -> str:
    """The platform's weight format (kernels.weight_format), but codes where the decoded weights would take more
    than half of a device's memory (a released checkpoint decoded to float32 is ~7x its download)."""
    fmt = kernels.weight_format()
    if fmt == "decoded" and resident_bytes(params, "decoded", jdtype) / n_devices > device_memory() / 2:
        return "codes"
    return fmt


def _rescaler(numerics):
    """The fp8 weight rewrite into trn2's e4m3 range when the numerics ask for it (else None)."""
    if not numerics.trn2_weights:
        return None

    def rescale(codes, scale, block):
        return trn2_rescale(codes, scale, block, numerics.fp8_max)

    return rescale


@contextlib.contextmanager
def _progress(path: str, show: bool, what: str = ""):
    """A `report(done, total)` callback driving a tqdm bar over the checkpoint's tensors (on stderr) when `show`."""
    bar = None
    if show:
        bar = tqdm(desc=f"loading {os.path.basename(os.path.normpath(path))}{what}", unit="tensor", leave=False)

    def report(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    try:
        yield report
    finally:
        if bar is not None:
            bar.close()
