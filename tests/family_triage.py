"""Triage of fxmegatron over the family matrix (tests/families.py); a script, not a test.

    .venv/bin/python tests/family_triage.py [--no-tp] [--timeout S] [names...]

For each family, against a ``copy.deepcopy`` of the unmodified model, 3 SGD steps (lr 0.1) on
three different padded batches (make_batch seeds 0, 1, 2), comparing the loss at every step
(1e-5 relative) and every whole gradient at every step (1e-4 relative, floored at 1% of the
model's largest gradient, as tests/workers.py does):

  1p idiom     one process (mesh None), example batch {"input_ids": x, "labels": x}, ONE tensor
  1p separate  one process, example batch with two tensors
  tp2 / tp2+sp two gloo processes, mesh ("tp",) of 2, separate-tensor example, without and with
               sequence_parallel; "split" is numel(pm.parameters()) / numel(model.parameters())
               on a rank (1.00: nothing was split)

Each family runs in its own subprocess (its own session, killed as a group on timeout), so a
hang in a collective or a crash in one family does not take the others with it. The table is
printed and written to /tmp/family_triage.md; raw results go to /tmp/family_triage.json.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")   # as tests/conftest.py: before torch imports triton

import torch  # noqa: E402

from tests.families import FAMILIES, idiom_batch, make_batch  # noqa: E402

STEPS, LR, LOSS_TOL, GRAD_TOL = 3, 0.1, 1e-5, 1e-4
EXAMPLE_SEED = 100    # the example batch is none of the training batches
OUT_MD, OUT_JSON = "/tmp/family_triage.md", "/tmp/family_triage.json"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _rel_err(a, b, scale):
    return ((a - b).abs().max() / max(b.abs().max().item(), scale, 1e-30)).item()


def train_compare(pm, ref, fam) -> dict:
    """3 SGD steps of ``pm`` and ``ref`` on the same batches: the worst loss and gradient errors
    (which step, which parameter). Raises on the first exception, tagged with its step."""
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    out = {"loss_err": 0.0, "grad_err": 0.0, "worst": "", "losses": [], "losses_ref": []}
    for step in range(STEPS):
        b = make_batch(fam, seed=step)
        try:
            l_ref = ref(**b).loss
            l_ref.backward()
            loss = pm(b)
            loss.backward()
            full = pm.full_grads()
        except Exception as exc:
            raise RuntimeError(f"step {step}: {_first_line(exc)}") from exc
        out["losses_ref"].append(l_ref.item())
        out["losses"].append(loss.item())
        out["loss_err"] = max(out["loss_err"], abs(loss.item() - l_ref.item()) / abs(l_ref.item()))
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref.named_parameters()}
        scale = 0.01 * max(g.abs().max().item() for g in grads.values())
        for n, g in grads.items():
            e = _rel_err(full[n], g, scale) if n in full and full[n].shape == g.shape else float("inf")
            if e > out["grad_err"]:
                out["grad_err"], out["worst"] = e, f"{n}@{step}"
        opt_ref.step(); opt_ref.zero_grad()
        opt.step(); opt.zero_grad()
    out["ok"] = out["loss_err"] <= LOSS_TOL and out["grad_err"] <= GRAD_TOL
    return out


def _attempt(fam, mesh, example, **kw) -> dict:
    import fxmegatron
    model = fam.build()
    ref = copy.deepcopy(model)
    try:
        pm = fxmegatron.parallelize(model, mesh, example, **kw)
    except Exception as exc:
        return {"error": f"parallelize: {_first_line(exc)}"}
    frac = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in ref.parameters())
    try:
        res = train_compare(pm, ref, fam)
    except Exception as exc:
        return {"error": str(exc), "split": frac}
    res["split"] = frac
    return res


def single_process(name: str) -> dict:
    fam = FAMILIES[name]
    sep = make_batch(fam, EXAMPLE_SEED)
    return {"1p idiom": _attempt(fam, None, idiom_batch(fam, EXAMPLE_SEED)),
            "1p separate": _attempt(fam, None, sep)}


def tp_worker(rank, world, name, sps=(False, True)):
    """Run on each gloo process by run_distributed: one result per sequence_parallel setting."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    fam = FAMILIES[name]
    return {f"tp{world}{'+sp' if sp else ''}": _attempt(fam, mesh, make_batch(fam, EXAMPLE_SEED),
                                                          sequence_parallel=sp)
            for sp in sps}


def tensor_parallel(name: str, world: int = 2) -> dict:
    from tests.distributed import run_distributed
    from tests.family_triage import tp_worker as worker   # by module name, for spawn's pickling
    try:
        per_rank = run_distributed(worker, world, name)
    except Exception as exc:
        return {f"tp{world}": {"error": f"run_distributed: {_first_line(exc)}"}}
    merged = {}
    for key in per_rank[0]:
        rs = [r[key] for r in per_rank]
        errs = [f"rank {i}: {r['error']}" for i, r in enumerate(rs) if "error" in r]
        if errs:
            merged[key] = {"error": errs[0], "split": rs[0].get("split")}
            continue
        worst = max(rs, key=lambda r: r["grad_err"])
        merged[key] = {**worst, "loss_err": max(r["loss_err"] for r in rs), "ok": all(r["ok"] for r in rs)}
    return merged


# ---- orchestration ---------------------------------------------------------------------------
COLUMNS = ("1p idiom", "1p separate", "tp2", "tp2+sp")


def run_family(name: str, tp: bool, timeout: float) -> dict:
    """The family's checks in a child process of its own session (killed as a group on timeout)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/out.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, path] + ([] if tp else ["--no-tp"])
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        try:
            _, err = proc.communicate(timeout=timeout)
            crash = proc.returncode != 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)   # the child and the gloo ranks it spawned
            proc.communicate()
            err, crash = f"TIMEOUT after {timeout:.0f}s", True
        res = json.load(open(path)) if os.path.exists(path) else {}
    if crash:
        last = [ln for ln in (err or "").strip().splitlines() if ln.strip()][-1:] or ["?"]
        for col in COLUMNS if tp else COLUMNS[:2]:
            res.setdefault(col, {"error": f"child died: {last[0][:200]}"})
    return res


def child(name: str, path: str, tp: bool) -> None:
    res = single_process(name)
    json.dump(res, open(path, "w"))     # written before tp, so a tp hang keeps these
    if tp:
        res.update(tensor_parallel(name))
        json.dump(res, open(path, "w"))


def cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "error" in r:
        text = "ERR " + r["error"]
    else:
        text = (f"{'ok' if r['ok'] else '**MISMATCH**'} L{r['loss_err']:.0e} G{r['grad_err']:.0e}"
                + ("" if r["ok"] else f" `{r['worst']}`"))
    return text.replace("|", "\\|").replace("\n", " ")


def table(results: dict) -> str:
    lines = ["| family | features | heads/kv | 1p idiom | 1p separate | tp2 | split | tp2+sp |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        fam = FAMILIES[name]
        split = r.get("tp2", {}).get("split")
        lines.append(f"| {name} | {', '.join(fam.features)} | {fam.n_head}/{fam.n_kv_head} | "
                     f"{cell(r.get('1p idiom'))} | {cell(r.get('1p separate'))} | {cell(r.get('tp2'))} | "
                     f"{'-' if split is None else f'{split:.2f}'} | {cell(r.get('tp2+sp'))} |")
    return "\n".join(lines)


def main(argv) -> None:
    tp = "--no-tp" not in argv
    timeout = 600.0
    if "--timeout" in argv:
        timeout = float(argv[argv.index("--timeout") + 1])
    names = [a for a in argv if a in FAMILIES] or list(FAMILIES)
    unknown = [a for a in argv if not a.startswith("--") and a not in FAMILIES and not a.replace(".", "").isdigit()]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {list(FAMILIES)}")
    results = {}
    for name in names:
        t0 = time.time()
        results[name] = run_family(name, tp, timeout)
        print(f"{name:13s} {time.time() - t0:6.1f}s  " + "  ".join(f"{c}: {cell(results[name].get(c))}"
                                                             for c in COLUMNS), flush=True)
    md = table(results)
    print("\n" + md)
    with open(OUT_MD, "w") as f:
        f.write(md + "\n")
    with open(OUT_JSON, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], "--no-tp" not in sys.argv)
    else:
        main(sys.argv[1:])
