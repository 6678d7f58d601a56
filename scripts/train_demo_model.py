"""Train the small DeepSeek-V4 that `jdeep demo` ships, on text every machine has: the Python standard library's
own source files (sysconfig's stdlib path, split by file into train / validation).

    pip install -e '.[train]'
    python scripts/train_demo_model.py --out jdeep/demo_model --float-out /tmp/demo-float

Steps: a byte-level BPE (`tokenizers`, a few thousand ids, DeepSeek-V4's special tokens first: BOS 0, EOS 1, the
chat-role, thinking and tool-call markers), then next-token training of jdeep's own forward (model_step, float
numerics) with optax AdamW, then DeepSeek's quantisation recipe (fp8 e4m3 weights with ue8m0 128x128 block scales,
fp4 e2m1 routed experts with 1x32 scales) into a checkpoint folder exactly as DeepSeek publishes one: config.json,
model.safetensors, tokenizer.json, plus a model card (README.md) with the data, tokenizer, size, steps, loss curve
and the validation perplexity against a unigram model of the same tokenizer. Seeded and reproducible for a given
Python version (its stdlib is the data).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import numpy as np

try:
    import optax
except ImportError:
    sys.exit("training needs optax: pip install -e '.[train]'")

import jax
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

import jdeep
from jdeep.io.writer import float_config, named_tensors, write_checkpoint
from jdeep.tools.quality.evaluate import NUMERICS_MODES, compare, format_table, load_modes, read_texts
from jdeep.tools.testing.random_weights import random_checkpoint
from jdeep.tools.quality.stdlib_corpus import read_text, stdlib_files
from jdeep.tools.quality.mtp_eval import mtp_accuracy
from jdeep.tools.quality.train import MTP_WEIGHT, lm_loss, make_train_step, merge, split_trainable

# DeepSeek-V4's special tokens (tokenizer_config of the released models), ids 0.. in this order
SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
           "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
           "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
           "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
BOS, EOS = 0, 1


def demo_config(vocab_size: int) -> dict:
    """The shipped model's architecture: every V4 layer kind (sliding window, ratio-4 CSA with the indexer,
    ratio-16 HCA), a hash-routed and top-k MoE, mHC with 4 streams; dimensions that tile DeepSeek's 128-wide
    fp8 blocks, quantized as DeepSeek ships V4."""
    return {
        "model_type": "deepseek_v4", "vocab_size": vocab_size, "hidden_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2,
        "o_lora_rank": 64, "sliding_window": 64,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "num_hash_layers": 1, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 16, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 128, "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "compress_rope_theta": 160000, "max_position_embeddings": 4096, "bos_token_id": BOS, "eos_token_id": EOS,
        "num_nextn_predict_layers": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                                "expert_dtype": "fp4"},
    }


def train_tokenizer(files: list[str], vocab_size: int, path: str) -> Tokenizer:
    """A byte-level BPE with DeepSeek's special tokens as ids 0..15, saved as tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[AddedToken(s, special=True) for s in SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer)
    tok.save(path)
    return tok


def encode_files(tok: Tokenizer, files: list[str]) -> np.ndarray:
    """Every file as BOS + its tokens + EOS, concatenated: int32 [N]."""
    out = []
    for enc in tok.encode_batch([read_text(f) for f in files], add_special_tokens=False):
        out += [BOS] + enc.ids + [EOS]
    return np.asarray(out, np.int32)


def unigram_ppl(train: np.ndarray, val: np.ndarray, vocab: int) -> float:
    """Perplexity on `val` of the unigram model of `train` (add-one smoothed)."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1
    logp = np.log(counts / counts.sum())
    return math.exp(-logp[val[1:]].mean())


def batches(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(stream) - length, batch)
        yield np.stack([stream[s:s + length] for s in starts])


def evaluate(out: str, base: str, files: list[str], max_tokens: int, context: int) -> tuple[str, str]:
    """`jdeep eval`'s table of the written checkpoint in every numerics mode against its float weights, and the MTP
    block's next-next-token accuracy (float weights; the checkpoint in DeepSeek's numerics), on the first
    validation files (up to max_tokens tokens)."""
    models = {"float weights": jdeep.load(base), **load_modes(out, list(NUMERICS_MODES))}
    texts, n = [], 0
    files = [f for f in files if read_text(f).strip()]          # the stdlib has empty __init__.py files
    for path, ids in read_texts(files, models["float"].tokenizer, BOS):
        if n >= max_tokens:
            break
        texts.append((path, ids[:max_tokens - n]))
        n += len(texts[-1][1])
    result = compare(models, texts, base=models["float weights"], context=context, stride=context // 2)
    rows = ["| weights, numerics | positions | MTP top-1 (token t+2) | MTP = backbone's top-1 at t+1 | backbone top-1 |",
            "|---|---|---|---|---|"]
    for name, model in (("float weights", jdeep.load(base, mtp=True)),
                        ("fp8/fp4, DeepSeek's numerics", jdeep.load(out, mtp=True, **NUMERICS_MODES["deepseek"]))):
        acc = mtp_accuracy(model, [ids for _, ids in texts], context)
        rows.append(f"| {name} | {acc['positions']} | {acc['mtp_top1']:.1%} | {acc['agreement']:.1%} | "
                    f"{acc['main_top1']:.1%} |")
    return format_table(result), "\n".join(rows)


def model_card(folder: str, result: dict, raw: dict, table: str, mtp_table: str) -> None:
    """README.md of the checkpoint: data, tokenizer, size, training, loss curve and the evaluation tables."""
    curve = "\n".join(f"| {s} | {lm:.3f} | {mtp:.3f} | {kl:.3f} |"
                      for s, lm, mtp, kl in result["curve"][::4] + result["curve"][-1:])
    text = f"""# jdeep demo model: a small DeepSeek-V4 trained on the Python standard library

The model `jdeep demo` runs. Written by `scripts/train_demo_model.py` (seed {result["seed"]}) with jdeep's own forward
as the model, in DeepSeek's published checkpoint format: config.json, model.safetensors (fp8 e4m3 weights with ue8m0
128x128 block scales, fp4 e2m1 routed experts with 1x32 scales), tokenizer.json.

- Architecture: DeepSeek-V4, {raw["num_hidden_layers"]} layers ({", ".join(raw["layer_types"])}), hidden
  {raw["hidden_size"]}, {raw["num_attention_heads"]} heads of {raw["head_dim"]}, mHC with {raw["hc_mult"]} streams,
  sliding window {raw["sliding_window"]}, compressed sparse attention (ratio 4, lightning indexer, top-{raw["index_topk"]})
  and heavily compressed attention (ratio 16), {raw["n_routed_experts"]} routed experts (top-{raw["num_experts_per_tok"]},
  the first layer hash-routed) + {raw["n_shared_experts"]} shared; {result["params"] / 1e6:.1f} M parameters.
- Data: the .py files of Python {result["python"]}'s standard library (sysconfig's stdlib path, site-packages
  excluded), each file BOS + tokens + EOS; split by file (a CRC32 of the path): {result["train_tokens"]} training
  tokens, {result["val_tokens"]} validation tokens.
- Tokenizer: byte-level BPE ({raw["vocab_size"]} ids) trained on the training files; ids 0-15 are DeepSeek-V4's
  special tokens (BOS 0, EOS 1, pad, User/Assistant, think, tool-call markers).
- Training: {result["steps"]} steps of AdamW (warmup + cosine), batch {result["batch"]} x {result["seq_len"]} tokens
  ({result["tokens_seen"] / 1e6:.1f} M tokens seen), in float numerics, on 2 CPU cores in {result["minutes"]:.0f}
  minutes. Objectives, as DeepSeek trains V4: the next-token loss, plus {MTP_WEIGHT} x the MTP block's next-next-token
  loss (`mtp.0`: the backbone's final streams at t and the embedding of token t+1 predict token t+2), plus the
  lightning indexer's KL divergence from the main attention's distribution over the compressed entries (the
  indexer's inputs and its target detached, so it trains only the indexer).
- Validation perplexity (float weights, windows of {result["seq_len"]} tokens): **{result["val_ppl"]:.1f}**; a unigram
  model of the same tokenizer: {result["unigram_ppl"]:.1f}.

## Evaluation (`jdeep eval`, validation files, every numerics mode against the float weights)

```
{table}
```

## MTP block (next-next-token prediction, validation files, windows of {result["seq_len"]} tokens)

{mtp_table}

The middle column is the greedy acceptance rate of a one-token MTP draft (teacher-forced): how often the MTP
block's guess for token t+2 is what the backbone itself predicts there.

## Loss curve (training batches)

| step | next-token loss | MTP loss | indexer KL |
|---|---|---|---|
{curve}
"""
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="jdeep/demo_model", help="the quantized checkpoint folder to write")
    p.add_argument("--float-out", help="also write the float checkpoint here (the base of `jdeep eval`)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=1800)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-every", type=int, default=50, help="1 in N stdlib files is validation")
    p.add_argument("--val-tokens", type=int, default=65536, help="validation tokens scored at the end")
    p.add_argument("--eval-tokens", type=int, default=16384, help="validation tokens of the evaluation table")
    p.add_argument("--work", default="/tmp/jdeep-demo-train", help="scratch folder (tokenizer, init weights)")
    p.add_argument("--card-only", action="store_true", help="only rewrite --out from --float-out, evaluate it and "
                                                             "write its model card (the last run's train_result.json)")
    args = p.parse_args()
    if args.card_only:
        with open(os.path.join(args.work, "train_result.json")) as f:
            result = {"seed": args.seed, "batch": args.batch, "seq_len": args.seq_len, **json.load(f)}
        with open(os.path.join(args.out, "config.json")) as f:
            raw = json.load(f)
        base = jdeep.load(args.float_out, mtp=True)
        write_checkpoint(args.out, raw, named_tensors(base.config, base.plan, base.params), dtype="bfloat16")
        table, mtp_table = evaluate(args.out, args.float_out, stdlib_files(args.val_every)[1], args.eval_tokens,
                                    args.seq_len)
        print(table, mtp_table, sep="\n")
        model_card(args.out, result, raw, table, mtp_table)
        return 0
    t_start = time.time()
    os.makedirs(args.work, exist_ok=True)
    train_files, val_files = stdlib_files(args.val_every)
    tok_path = os.path.join(args.work, "tokenizer.json")
    tok = train_tokenizer(train_files, args.vocab_size, tok_path)
    train_ids, val_ids = encode_files(tok, train_files), encode_files(tok, val_files)
    print(f"data: {len(train_files)} train files ({len(train_ids)} tokens), {len(val_files)} validation files "
          f"({len(val_ids)} tokens); tokenizer {tok.get_vocab_size()} ids, {time.time() - t_start:.0f} s", flush=True)

    raw = demo_config(tok.get_vocab_size())
    init = os.path.join(args.work, "init")
    random_checkpoint(float_config(jdeep.ModelConfig.from_dict(raw)).to_dict(), init, seed=args.seed)
    model = jdeep.load(init, mtp=True)
    config, plan = model.config, model.plan
    train, fixed = split_trainable(model.params)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(model.params))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10), args.steps, args.lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.01))
    opt_state = optimizer.init(train)
    step = make_train_step(config, plan, optimizer)
    mask = np.ones((args.batch, args.seq_len - 1), bool)
    rng = np.random.default_rng(args.seed)
    curve = []
    t0 = time.time()
    for i, tokens in zip(range(args.steps), batches(train_ids, args.batch, args.seq_len, rng)):
        train, opt_state, losses = step(train, fixed, opt_state, tokens, mask)
        if i % 25 == 0 or i == args.steps - 1:
            losses = {k: float(v) for k, v in losses.items()}
            curve.append((i, losses["lm"], losses["mtp"], losses["index_kl"]))
            print(f"step {i:5d}  loss {losses['lm']:.3f}  mtp {losses['mtp']:.3f}  indexer KL {losses['index_kl']:.3f}"
                  f"  {(time.time() - t0) / (i + 1):.2f} s/step", flush=True)
    params = merge(train, fixed)

    # validation: next-token loss over consecutive windows of the held-out files (float numerics)
    n = min(len(val_ids) - 1, args.val_tokens) // args.seq_len
    windows = val_ids[:n * args.seq_len].reshape(n, args.seq_len)
    val_loss = jax.jit(functools.partial(lm_loss, config=config, plan=plan))
    val_nll = np.mean([float(val_loss(params, windows[k:k + args.batch])) for k in range(0, n - args.batch + 1, args.batch)])
    result = {"val_ppl": math.exp(val_nll), "seed": args.seed, "batch": args.batch, "seq_len": args.seq_len, "unigram_ppl": unigram_ppl(train_ids, val_ids, tok.get_vocab_size()),
              "params": n_params, "steps": args.steps, "tokens_seen": args.steps * args.batch * args.seq_len,
              "train_tokens": int(len(train_ids)), "val_tokens": int(len(val_ids)), "curve": curve,
              "minutes": (time.time() - t_start) / 60, "python": sys.version.split()[0]}
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)

    named = named_tensors(config, plan, params)
    if args.float_out:
        write_checkpoint(args.float_out, float_config(jdeep.ModelConfig.from_dict(raw)).to_dict(), named)
        tok.save(os.path.join(args.float_out, "tokenizer.json"))
    write_checkpoint(args.out, raw, named, dtype="bfloat16")     # as DeepSeek ships: the unquantized weights in bf16
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.work, "train_result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} in {(time.time() - t_start) / 60:.1f} min", flush=True)
    if args.float_out:
        table, mtp_table = evaluate(args.out, args.float_out, val_files, args.eval_tokens, args.seq_len)
        print(table, mtp_table, sep="\n", flush=True)
        model_card(args.out, result, raw, table, mtp_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
