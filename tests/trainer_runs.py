"""Running ``fxmegatron train`` as a user does (torchrun, gloo, CPU) from tests, and reading what it wrote."""
import csv
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "data", "tiny.txt")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def write_config(path, sections):
    """A TOML file from {section: {key: value}} (strings, numbers, booleans, lists, one nested table)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\") + '"'
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)
    lines = []
    for section, table in sections.items():
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        lines.append(f"[{section}]")
        lines += [f"{k} = {val(v)}" for k, v in table.items() if not isinstance(v, dict)]
        for k, sub in nested.items():
            lines.append(f"[{section}.{k}]")
            lines += [f"{kk} = {val(vv)}" for kk, vv in sub.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def env(extra=None):
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.pop("TRITON_INTERPRET", None)     # the optimizer's torch path: the interpreter is slow
    e.update(extra or {})
    return e


def command(cfg, nproc, *args):
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "-m", "fxmegatron.train", str(cfg), *args]


def train(cfg, nproc, *args, extra_env=None, timeout=300):
    """Run to the end; returns the CompletedProcess (stdout and stderr together)."""
    return subprocess.run(command(cfg, nproc, *args), cwd=ROOT, env=env(extra_env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def start(cfg, nproc, *args, extra_env=None):
    return subprocess.Popen(command(cfg, nproc, *args), cwd=ROOT, env=env(extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _children(pid):
    """Every live descendant of ``pid`` (from /proc: torchrun starts its workers in sessions of
    their own, so killing torchrun's process group leaves them running)."""
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_job(proc, timeout=30):
    """SIGKILL a job started by ``start`` and every process under it at once, as a crashed node
    takes them all, and wait until none is left (a surviving worker would go on writing the run's
    files while the next run resumes)."""
    procs = [proc.pid] + _children(proc.pid)
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    t0 = time.time()
    while any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in procs):
        if time.time() - t0 > timeout:
            raise RuntimeError(f"processes {procs} outlived SIGKILL for {timeout} s")
        time.sleep(0.05)


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def rows(out_dir):
    path = os.path.join(out_dir, "loss.csv")
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def wait_rows(out_dir, n, proc, timeout=240):
    """Wait until loss.csv has ``n`` rows (or the process ended)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if len(rows(out_dir)) >= n or proc.poll() is not None:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{out_dir}: {n} rows not written within {timeout} s")


def tiny_tokenizer(path, vocab=100):
    """A Hugging Face tokenizer of ``vocab`` tokens (a word-level one over made-up words), saved with
    save_pretrained to ``path``, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = {"<unk>": 0, "<eos>": 1}
    for i in range(vocab - 2):
        words[f"w{i}"] = i + 2
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(path))
    return path
