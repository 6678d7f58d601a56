"""Grouping of the layer stack into homogeneous, scannable segments.

A layer's *kind* is its attention kind plus whether its MoE is hash-routed: layers of one kind have
identical parameter and state shapes. The kind also carries what differs between the model families, so one
block serves both: where the compressed caches live (V4: per layer; V4.1: per KV source, shared), when the
mHC pre-mix is applied (V4: by the half that computes it; V4.1: by the next half) and the V4.1 indexer role
and Engram update. The stack is cut into segments; each segment repeats a short
pattern of kinds (`pattern`) `reps` times, so it runs as one `lax.scan` of `reps` steps whose body
applies the pattern. V4-Flash, for example, becomes [sliding/hash]x2, [csa4/hash]x1, [hca128, csa4]x20:
the compiled program holds four layer bodies (five blocks) whatever the depth.

Parameters and state are stored per (segment, slot) with a leading axis of length `reps`
(layer-major), so a scan consumes whole arrays and never slices a copy of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import AttentionKind, ModelConfig

__all__ = ["LayerKind", "Segment", "LayerPlan", "build_plan", "mtp_depths", "mtp_kind", "dspark_stages",
           "dspark_kind", "dspark_stage_config", "dspark_tap_layers"]

MAX_PERIOD = 6

# V4.1 indexer roles of a compressed layer (model-spec.md §5.5)
REUSE = "reuse"          # uses the top-k published by the latest index source
OWN = "own"              # runs its own indexer and publishes its top-k
CANDIDATE = "candidate"  # OWN, and also publishes the two-level block candidate mask
RESTRICTED = "restricted"  # OWN, with scores outside the published candidate mask set to -inf


@dataclass(frozen=True)
class SharedRole:
    """What a V4.1 compressed layer owns and publishes (the KV it reads is its source's)."""

    kv_source: bool   # computes the compressed KV and index keys of its group of layers
    index: str        # REUSE, OWN, CANDIDATE or RESTRICTED


@dataclass(frozen=True)
class LayerKind:
    attn: AttentionKind
    hash_moe: bool
    shared: SharedRole | None = None   # V4.1 compressed layers
    engram: bool = False               # V4.1 Engram update of the streams before the block
    shared_kv: bool = False            # V4.1: own sliding window only; compressed KV / index keys in state["sources"]
    delayed_premix: bool = False       # V4.1: each half collapses its input with the previous half's pre-mix

    @property
    def name(self) -> str:
        name = self.attn.name + ("_hash" if self.hash_moe else "")
        if self.shared is not None:   # V4.1 compressed layer: c<ratio>[_src][_<indexer role>]
            name = f"c{self.attn.ratio}"
            name += ("_src" if self.shared.kv_source else "") + ("" if self.shared.index == REUSE else "_" + self.shared.index)
        return name + ("_engram" if self.engram else "")


@dataclass(frozen=True)
class Segment:
    first_layer: int
    pattern: tuple[LayerKind, ...]
    reps: int

    @property
    def n_layers(self) -> int:
        return len(self.pattern) * self.reps

    def layer(self, rep: int, slot: int) -> int:
        return self.first_layer + rep * len(self.pattern) + slot


@dataclass(frozen=True)
class LayerPlan:
    segments: tuple[Segment, ...]
    mtp: Segment | None = None   # the MTP blocks `mtp.0..` when the model runs them (build_plan(mtp=True))
    dspark: Segment | None = None  # V4.1: the DSpark drafter's stages `mtp.0..` instead (build_plan(mtp=True))

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        return tuple(k for seg in self.segments for k in seg.pattern)

    @property
    def delayed_premix(self) -> bool:
        """Whether the streams are collapsed with a pre-mix carried from the previous half (V4.1), which then
        also collapses them before the head; else each half and the head compute their own (V4)."""
        return any(k.delayed_premix for k in self.kinds)

    @property
    def shared_kv(self) -> bool:
        """Whether layers publish top-k selections to later layers (V4.1 cross-layer sharing)."""
        return any(k.shared_kv for k in self.kinds)

    @property
    def has_engram(self) -> bool:
        return any(k.engram for k in self.kinds)

    def locate(self, layer: int) -> tuple[int, int, int]:
        """Backbone layer index -> (segment, slot, rep)."""
        for s, seg in enumerate(self.segments):
            off = layer - seg.first_layer
            if 0 <= off < seg.n_layers:
                return s, off % len(seg.pattern), off // len(seg.pattern)
        raise IndexError(f"layer {layer} is outside the plan")


def _shared_role(config: ModelConfig, layer: int) -> SharedRole | None:
    sh = config.sharing
    if sh is None or config.attention_kinds[layer].ratio == 0:
        return None
    index = REUSE
    if layer == sh.candidate_source:
        index = CANDIDATE
    elif layer in sh.index_sources:
        index = OWN
        cand = sh.candidate_source
        if cand is not None and layer > cand and config.kv_source_of(layer) == config.kv_source_of(cand):
            index = RESTRICTED
    return SharedRole(kv_source=layer in sh.kv_sources, index=index)


def layer_kinds(config: ModelConfig) -> list[LayerKind]:
    engram = set(config.engram.layer_ids) if config.engram else set()
    shared, delayed = config.sharing is not None, config.is_v41
    return [LayerKind(a, h, _shared_role(config, i), i in engram, shared_kv=shared, delayed_premix=delayed)
            for i, (a, h) in enumerate(zip(config.attention_kinds, config.hash_moe))]


def mtp_depths(config: ModelConfig) -> int:
    """How many DeepSeek-V4 MTP blocks (model-spec.md §4.7) the checkpoint carries: `num_nextn_predict_layers`,
    unless those blocks are a DSpark drafter (a different module, §5.8); V4.1 ships only the drafter."""
    return config.n_mtp_layers if config.dspark is None and not config.is_v41 else 0


def mtp_kind(config: ModelConfig) -> LayerKind:
    """An MTP block's kind: sliding window only, a top-k (not hash-routed) MoE with a routing bias."""
    return LayerKind(AttentionKind(0), False)


def dspark_stages(config: ModelConfig) -> int:
    """How many DSpark drafter stages (model-spec.md §5.8) a DeepSeek-V4.1 checkpoint carries (0 without DSpark)."""
    return config.dspark.n_layers if config.dspark is not None and config.is_v41 else 0


def dspark_kind(config: ModelConfig) -> LayerKind:
    """A DSpark stage's kind: a V4.1 sliding-window layer (own window, delayed pre-mix) with a top-k MoE."""
    return LayerKind(AttentionKind(0), False, shared_kv=True, delayed_premix=True)


def dspark_stage_config(config: ModelConfig) -> ModelConfig:
    """The config a DSpark stage's block runs with: the backbone's, except its MoE's expert counts
    (dspark_n_routed_experts / dspark_num_experts_per_tok; 0 falls back to the backbone's, as DeepSeek's
    `get_moe_config` does for layer ids >= n_layers)."""
    ds = config.dspark
    return config.replace(n_routed_experts=ds.n_routed_experts or config.n_routed_experts,
                          n_activated_experts=ds.n_activated_experts or config.n_activated_experts)


def build_plan(config: ModelConfig, max_period: int = MAX_PERIOD, mtp: bool = False) -> LayerPlan:
    """Greedy cut: at each layer take the period whose repetition covers the most layers.

    Ties prefer the shorter period; a period is only worth it when it repeats (reps >= 2),
    otherwise the segment is a single layer. mtp: the plan also holds the checkpoint's drafter blocks `mtp.*`,
    as one segment numbered after the backbone: DeepSeek-V4's MTP blocks (`mtp`, `mtp_depths` repetitions) or
    DeepSeek-V4.1's DSpark stages (`dspark`, `dspark_stages` repetitions); ValueError when there are none.
    """
    kinds = layer_kinds(config)
    n = len(kinds)
    segments = []
    i = 0
    while i < n:
        best_p, best_reps = 1, 1
        while i + best_reps < n and kinds[i + best_reps] == kinds[i]:
            best_reps += 1
        best_cover = best_reps
        for p in range(2, max_period + 1):
            if i + 2 * p > n:
                break
            pat = kinds[i:i + p]
            if all(k == pat[0] for k in pat):
                continue  # covered by period 1
            reps = 1
            while i + (reps + 1) * p <= n and kinds[i + reps * p:i + (reps + 1) * p] == pat:
                reps += 1
            if reps >= 2 and reps * p > best_cover:
                best_p, best_reps, best_cover = p, reps, reps * p
        segments.append(Segment(i, tuple(kinds[i:i + best_p]), best_reps))
        i += best_p * best_reps
    mtp_segment = dspark_segment = None
    if mtp:
        if mtp_depths(config):
            mtp_segment = Segment(n, (mtp_kind(config),), mtp_depths(config))
        elif dspark_stages(config):
            dspark_segment = Segment(n, (dspark_kind(config),), dspark_stages(config))
        else:
            what = "no MTP block"
            if config.dspark is not None:
                what = "a DSpark drafter on a DeepSeek-V4 backbone (model-spec.md §5.8, not run by jdeep),"
            elif config.n_mtp_layers:
                what = "a DSpark-style drafter without its DSpark fields (dspark_block_size),"
            raise ValueError(f"this model has {what} (num_nextn_predict_layers={config.n_mtp_layers}): "
                             "mtp=True needs DeepSeek-V4's MTP blocks or DeepSeek-V4.1's DSpark stages")
    return LayerPlan(tuple(segments), mtp_segment, dspark_segment)


def dspark_tap_layers(config: ModelConfig) -> tuple[int, ...]:
    """The DSpark drafter's target layers (model_step(taps=True)); ValueError for a model without them."""
    if config.dspark is None or not config.dspark.target_layer_ids:
        raise ValueError("taps=True reads the DSpark drafter's target layers (dspark_target_layer_ids); this model "
                         "has none")
    bad = [i for i in config.dspark.target_layer_ids if not 0 <= i < config.n_layers]
    if bad:
        raise ValueError(f"dspark_target_layer_ids {bad} are not backbone layers [0, {config.n_layers})")
    return tuple(sorted(set(config.dspark.target_layer_ids)))   # DeepSeek appends them while walking the layers
