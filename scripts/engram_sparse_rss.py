"""Host memory of Engram row gathers from tables far larger than RAM (not a timed test).

Writes a sparse safetensors file holding DeepSeek-V4.1's two released Engram tables (layers 1 and 14,
384006168 / 384016682 rows of 256 fp8 codes + 8 e8m0 scale bytes: ~189 GiB logical, ~1 MiB on disk),
fills a few known rows, opens it with jdeep.io.engram_tables.EngramTables, gathers the row ids of a random chunk
(some pointed at the known rows), checks the bytes, and reports the resident set size before and after
the gather against the table size and the pages the gathered rows cover.

    python scripts/engram_sparse_rss.py [--dir /tmp] [--batch 2] [--seq 16] [--json out.json]

The test suite imports `run` from here (tests/test_engram.py), so both measure the same thing.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile

import numpy as np

from jdeep.io.engram_tables import EngramLayout, EngramTables, hash_ids
from jdeep.tools.perf.memory import status_bytes

PAGE = os.sysconf("SC_PAGE_SIZE")
HEAD_DIM = 256
RELEASED = {"layer_ids": [1, 14], "max_ngram_size": 4, "n_heads": 8, "engram_vocab_size": 16_000_000,
            "compressed_vocab_size": 99_092, "pad_class": 2}


def write_sparse_header(path: str, layer_ids: list[int], rows: list[int], head_dim: int) -> dict[str, int]:
    """Write the safetensors header for each layer's `engram.embed.weight` (F8_E4M3 [rows, head_dim])
    and `.scale` (F8_E8M0 [rows, head_dim/32]) and extend the file to its full size without writing the
    data (a hole). Returns the absolute file offset of each tensor's data."""
    header, offset, starts = {}, 0, {}
    for layer, n in zip(layer_ids, rows):
        for suffix, dtype, width in (("weight", "F8_E4M3", head_dim), ("scale", "F8_E8M0", head_dim // 32)):
            name = f"layers.{layer}.engram.embed.{suffix}"
            header[name] = {"dtype": dtype, "shape": [n, width], "data_offsets": [offset, offset + n * width]}
            starts[name] = offset
            offset += n * width
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return {name: 8 + len(raw) + start for name, start in starts.items()}


def write_rows(path: str, start: int, rows: np.ndarray, values: np.ndarray) -> None:
    """Write values uint8 [n, width] into rows int64 [n] of the tensor whose data begins at `start`."""
    width = values.shape[1]
    fd = os.open(path, os.O_WRONLY)
    try:
        for r, v in zip(rows.tolist(), values):
            os.pwrite(fd, v.tobytes(), start + r * width)
    finally:
        os.close(fd)


def pages_covered(starts: list[int], ids: np.ndarray, width: int) -> int:
    """Distinct pages holding rows ids (any int array) of width bytes, for tensors beginning at starts."""
    pages = set()
    for start in starts:
        first = (start + ids.ravel() * width) // PAGE
        last = (start + (ids.ravel() + 1) * width - 1) // PAGE
        pages.update(first.tolist())
        pages.update(last.tolist())
    return len(pages)


def run(directory: str, batch: int = 2, seq: int = 16, n_known: int = 64, seed: int = 0) -> dict:
    """Build the sparse file in a new folder under `directory`, gather, check, measure; the folder is
    removed afterwards.

    Returns a dict of sizes (bytes) and counts; raises OSError("sparse") when the filesystem allocated
    the holes, AssertionError when a gathered row differs from what was written."""
    rng = np.random.default_rng(seed)
    layout = EngramLayout.create(**RELEASED)
    n_eng = len(layout.layer_ids)
    folder = tempfile.mkdtemp(prefix="engram-sparse-", dir=directory)
    path = os.path.join(folder, "model.safetensors")
    try:
        starts = write_sparse_header(path, list(layout.layer_ids), list(layout.table_rows), HEAD_DIM)
        st = os.stat(path)
        if st.st_blocks * 512 > 64 << 20:
            raise OSError("sparse", f"{directory} allocated {st.st_blocks * 512} bytes for a hole")

        # a random chunk's row ids, a quarter of them redirected to rows with known content
        ids = hash_ids(layout, rng.integers(0, layout.compressed_vocab_size, (batch, seq + layout.history)))
        known_codes, known_scales = [], []
        for i, layer in enumerate(layout.layer_ids):
            n_rows = layout.table_rows[i]
            known = np.unique(np.concatenate([[0, n_rows - 1], rng.integers(0, n_rows, n_known - 2)]))
            codes = rng.integers(0, 256, (known.size, HEAD_DIM), dtype=np.uint8)
            scales = rng.integers(100, 150, (known.size, HEAD_DIM // 32), dtype=np.uint8)
            write_rows(path, starts[f"layers.{layer}.engram.embed.weight"], known, codes)
            write_rows(path, starts[f"layers.{layer}.engram.embed.scale"], known, scales)
            pick = rng.random(ids[:, :, i].shape) < 0.25
            ids[:, :, i][pick] = rng.choice(known, int(pick.sum()))
            known_codes.append(dict(zip(known.tolist(), codes)))
            known_scales.append(dict(zip(known.tolist(), scales)))
        disk = os.stat(path).st_blocks * 512

        tables = EngramTables(folder, layout.layer_ids, layout)
        rss0, file0 = status_bytes("VmRSS"), status_bytes("RssFile")
        codes, scales = tables.gather(ids)
        rss1, file1 = status_bytes("VmRSS"), status_bytes("RssFile")

        zeros_c, zeros_s = np.zeros(HEAD_DIM, np.uint8), np.zeros(HEAD_DIM // 32, np.uint8)
        hits = 0
        for i in range(n_eng):
            for idx in np.ndindex(ids.shape[:2] + ids.shape[3:]):
                row = int(ids[idx[0], idx[1], i, idx[2]])
                hits += row in known_codes[i]
                assert np.array_equal(codes[(i,) + idx], known_codes[i].get(row, zeros_c)), (i, idx, row)
                assert np.array_equal(scales[(i,) + idx], known_scales[i].get(row, zeros_s)), (i, idx, row)

        touched = PAGE * sum(
            pages_covered([starts[f"layers.{layer}.engram.embed.weight"]], ids[:, :, i], HEAD_DIM)
            + pages_covered([starts[f"layers.{layer}.engram.embed.scale"]], ids[:, :, i], HEAD_DIM // 32)
            for i, layer in enumerate(layout.layer_ids))
        return {"table_bytes": os.stat(path).st_size, "disk_bytes": disk, "rows_gathered": int(ids.size),
                "known_rows_hit": int(hits), "rss_before": rss0, "rss_after": rss1, "rss_growth": rss1 - rss0,
                "rss_file_growth": file1 - file0, "bytes_touched": touched,
                "gathered_bytes": int(codes.nbytes + scales.nbytes)}
    finally:
        if os.path.exists(path):
            os.remove(path)
        os.rmdir(folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="folder for the sparse file (removed afterwards)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args()
    try:
        out = run(args.dir, args.batch, args.seq)
    except OSError as e:
        if e.args and e.args[0] == "sparse":
            print(f"skipped: {e.args[1]}", file=sys.stderr)
            return 2
        raise
    gib, mib = 1 << 30, 1 << 20
    print(f"logical table size : {out['table_bytes'] / gib:.1f} GiB ({out['table_bytes']} bytes; "
          f"{out['disk_bytes'] / mib:.2f} MiB on disk)")
    print(f"rows gathered      : {out['rows_gathered']} ({out['known_rows_hit']} known rows checked, "
          f"{out['gathered_bytes'] / 1024:.0f} KiB of codes + scales)")
    print(f"RSS before / after : {out['rss_before'] / mib:.1f} / {out['rss_after'] / mib:.1f} MiB "
          f"(+{out['rss_growth'] / mib:.2f} MiB; file-backed +{out['rss_file_growth'] / mib:.2f} MiB)")
    print(f"bytes touched      : {out['bytes_touched'] / mib:.2f} MiB (distinct {PAGE}-byte pages under the rows)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
