"""The doctor's report: report.json (everything run_doctor returned) and report.md (the same for a person, to attach
to a bug report): environment and what is missing, one row per program (rules, compiles, crash rate, time, artifact,
error codes, the first log line of a failure), the reproducers with the command that replays each, the numerics
checks and the speed tables."""

from __future__ import annotations

import json
import os
import statistics

__all__ = ["write_report", "render_markdown", "summary"]


def _cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def summary(result: dict) -> dict:
    """Counts for the report's first lines and the command's exit status."""
    progs = result["programs"]
    compiled = [p["compile"] for p in progs if "compile" in p]
    checks = result.get("numerics") or []
    return {"programs": len(progs),
            "rules_failed": sum(1 for p in progs if not p.get("rules", {}).get("ok", True)),
            "compiled": len(compiled),
            "compile_failed": sum(1 for c in compiled if c["failures"]),
            "attempts": sum(len(c["attempts"]) for c in compiled),
            "failed_attempts": sum(c["failures"] for c in compiled),
            "reproducers": sum(1 for p in progs if p.get("reproducer", {}).get("file")),
            "checks_failed": sum(1 for c in checks if c["status"] == "fail"),
            "missing": [m["package"] for m in result["environment"].get("missing", [])]}


def _environment(env: dict) -> list[str]:
    lines = ["## Environment", ""]
    rows = [[k, v] for k, v in env.items() if k not in ("versions", "missing", "expected") and not isinstance(v, dict)]
    lines += _table(["", ""], rows)
    versions = env.get("versions", {})
    expected = env.get("expected", {})
    if versions:
        lines += ["", *_table(["package", "installed", "jdeep expects"],
                              [[k, v, expected.get(k, "")] for k, v in versions.items()])]
    missing = env.get("missing", [])
    if missing:
        lines += ["", "Missing or not the expected version:", ""]
        lines += [f"- `{m['package']}`: {m.get('found')} (wants {m.get('wanted')}): `{m.get('install')}`"
                  for m in missing]
    return lines + [""]


def _programs(progs: list[dict]) -> list[str]:
    rows = []
    for p in progs:
        rules = p.get("rules")
        r = "—" if rules is None else ("ok" if rules["ok"] else "FAIL " + ", ".join(
            sorted({v["rule"] for v in rules["violations"]})))
        c = p.get("compile")
        if c is None:
            rows.append([p["name"], r, "—", "", "", "", "", ""])
            continue
        codes = ", ".join(f"{k} ×{n}" for k, n in c["error_codes"].items())
        first = next((a["log_head"][0] for a in c["attempts"] if not a["ok"] and a["log_head"]), "")
        rows.append([p["name"], r, f"{c['passes']}/{len(c['attempts'])}", f"{c['crash_rate']:.0%}",
                     f"{c['median_seconds']:.1f}", f"{c['max_artifact_bytes'] / 2 ** 20:.1f} MiB", codes, first[:120]])
    return ["## Programs", "", *_table(["program", "rules", "compiled", "crash rate", "median s", "artifact",
                                        "error codes", "first log line of a failure"], rows), ""]


def _reproducers(progs: list[dict]) -> list[str]:
    reps = [(p["name"], p["reproducer"]) for p in progs if "reproducer" in p]
    if not reps:
        return []
    rows = []
    for name, r in reps:
        if "error" in r:
            rows.append([name, "—", "", "", "", "", r["error"]])
        else:
            rows.append([name, r["file"], r.get("error_code") or "", r.get("stage") or "", r["n_ops"], r["path"],
                         f"`sh {r['command']}` ({r['tests']} compiles to find)"])
    return ["## Minimal reproducers", "", "Each file is a standalone StableHLO module that still fails; its .sh "
            "replays the compile (from any folder; rerun it a few times for an intermittent crash).", "",
            *_table(["program", "file", "error", "stage", "ops", "where in the program", "replay"], rows), ""]


def _numerics(checks: list[dict] | None) -> list[str]:
    if checks is None:
        return ["## Numerics", "", "Not run (a preset has no weights, or --skip numerics).", ""]
    rows = [[c["name"], c["status"].upper() if c["status"] == "fail" else c["status"], c["detail"]] for c in checks]
    return ["## Numerics", "", *_table(["check", "status", "detail"], rows), ""]


def _speed(speed: dict | None) -> list[str]:
    if speed is None:
        return ["## Speed", "", "Not run (a preset has no weights, or --skip speed).", ""]
    lines = ["## Speed", ""]
    for section, data in speed.items():
        lines += [f"### {section}", "", "```", json.dumps(data, indent=1, default=str), "```", ""]
    return lines


def render_markdown(result: dict) -> str:
    s = summary(result)
    opts = result["options"]
    what = f"`{opts['model']}`" if opts.get("model") else f"preset `{opts['preset']}`"
    secs = [p["compile"]["median_seconds"] for p in result["programs"] if "compile" in p]
    lines = ["# jdeep doctor report", "",
             f"{what}, {opts['mode']} mode, {opts['dtype']}, batch buckets {opts['batch_sizes']}, prefill "
             f"{opts['prefill_len']}, state {opts['max_len']}; {result.get('seconds', 0)} s.", "",
             f"- {s['programs']} programs; compile-safety rules failed on {s['rules_failed']}",
             f"- {s['compiled']} compiled {opts['repeat']}x each: {s['compile_failed']} failed at least once "
             f"({s['failed_attempts']}/{s['attempts']} attempts failed)"
             + (f"; median compile {statistics.median(secs):.1f} s" if secs else ""),
             f"- {s['reproducers']} minimal reproducers in repro/",
             f"- numerics: {s['checks_failed']} failed checks" if result.get("numerics") is not None
             else "- numerics: not run",
             f"- missing: {', '.join(s['missing'])}" if s["missing"] else "- nothing missing", ""]
    check = result.get("compiler_check")
    if check is not None and not check["ok"]:
        lines += ["**The compiler failed on a one-op program** "
                  f"({check['error_code']}): nothing was compiled. Its log:", "", "```", *check["log_head"], "```", ""]
    lines += _environment(result["environment"]) + _programs(result["programs"]) + _reproducers(result["programs"])
    lines += _numerics(result.get("numerics")) + _speed(result.get("speed"))
    lines += ["Attach report.md, report.json and repro/ to a bug report.", ""]
    return "\n".join(lines)


def write_report(result: dict, out_dir: str) -> tuple[str, str]:
    """report.json and report.md in out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    js, md = os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")
    with open(js, "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(md, "w") as f:
        f.write(render_markdown(result))
    return js, md
