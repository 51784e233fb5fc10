"""Every performance figure in README.md points to the docs/PERFORMANCE.md table it comes from.

README.md is split into blocks: a paragraph, or one list item with its wrapped lines (a nested
item is a block of its own); a table belongs to the block just before it (its caption). A
figure is a number with a performance unit: a speed-up (``1.166×``), ms, tokens/s, TFLOP/s,
GB/s, GiB, MFU, a percentage of copy bandwidth or a percentage faster / slower / of step time,
and, in a table, any number under a column headed by such a unit (or ``sbh``). A number next
to the word "target" is a target, not a figure. Each block holding a figure must link to
sections of docs/PERFORMANCE.md (``docs/PERFORMANCE.md#anchor``) that exist, and every figure of
the block must appear, as written, in one of the sections it links.

docs/PERFORMANCE.md: every ``##``/``###`` section that holds a table states its command, date,
device and commit (and, if the table has an MFU column, its MFU denominator).
"""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PERF = os.path.join(ROOT, "docs", "PERFORMANCE.md")

NUM = r"\d+(?:[ ,]\d{3})*(?:\.\d+)?"
RANGE = rf"{NUM}(?:\s*[–-]\s*{NUM})?"
# (regex, group holding the number or range); each is searched in a block's text with inline
# code spans removed and line breaks joined.
FIGURES = [
    rf"({RANGE})×",                                                # speed-ups: 1.166×, 0.996–1.002×
    r"(\d+\.\d+)x(?![\w])",                                        # 1.166x
    rf"({NUM})\s+against\s+({NUM})\s*(?:ms|GiB)\b",               # "123.8 against 144.3 ms"
    rf"({RANGE})\s*(?:ms|µs)\b",
    rf"({NUM})\s*tokens/s",
    rf"({NUM})\s*TFLOP/s",
    rf"({NUM})\s*[GT]B/s",
    rf"({RANGE})\s*GiB\b",
    rf"MFU\s*({NUM})\s*%",
    rf"({NUM})\s*%\s*MFU",
    rf"({NUM})%(?:\s*/\s*({NUM})%)?(?=[^.;:()]*?\b(?:of copy|faster|slower|step time|of bf16)\b)",
]
UNIT_HEADER = re.compile(r"\b(ms|GiB|sbh|tokens/s|TFLOP/s|GB/s|MFU)\b|×")
LINK = re.compile(r"\]\((?:\./)?docs/PERFORMANCE\.md#([\w.-]+)\)")
ANY_PERF_LINK = re.compile(r"docs/PERFORMANCE\.md#([\w.-]+)")
LIST_ITEM = re.compile(r"^(\s*)(?:[-*+]|\d+\.)\s")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def github_anchor(heading):
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", lambda m: m.group(0) if m.group(0) == "_" else "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def perf_sections(text=None):
    """{anchor: (heading level, body)} of docs/PERFORMANCE.md's ## and ### sections (each body up
    to the next ## or ### heading)."""
    text = _read(PERF) if text is None else text
    sections, current, level, body, fence = {}, None, 0, [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^(#{2,3})\s+(.*)$", line)
        if m:
            if current is not None:
                sections[current] = (level, "\n".join(body))
            current, level, body = github_anchor(m.group(2)), len(m.group(1)), []
        elif current is not None:
            body.append(line)
    if current is not None:
        sections[current] = (level, "\n".join(body))
    return sections


def _numbers(match):
    out = []
    for g in match.groups():
        if g:
            out += [n.strip() for n in re.split(r"\s*[–-]\s*(?=\d)", g) if n.strip()]
    return out


def _is_target(text, start, end):
    return "target" in text[max(0, start - 25):start] or "target" in text[end:end + 15]


def figures_in(text):
    """The performance figures of a piece of prose, as the numbers written there."""
    text = re.sub(r"`[^`]*`", "", text)
    found = []
    for pattern in FIGURES:
        for m in re.finditer(pattern, text):
            if not _is_target(text, m.start(), m.end()):
                found += _numbers(m)
    return found


def table_figures(rows):
    """Numbers under the columns whose header names a performance unit, and unit figures in
    any cell."""
    cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
    if not cells:
        return []
    header = cells[0]
    unit_cols = {i for i, h in enumerate(header) if UNIT_HEADER.search(h)}
    found = []
    for row in cells[2:]:
        for i, cell in enumerate(row):
            found += figures_in(cell)
            if i in unit_cols:
                found += re.findall(NUM, re.sub(r"`[^`]*`", "", cell))
    return sorted(set(found), key=found.index)


def readme_blocks(text=None):
    """[(first line number, prose, table rows)] of README.md, code fences and headings skipped.
    A blank line between a caption and its table keeps them one block."""
    text = _read(README) if text is None else text
    blocks, cur, fence = [], None, False

    def close():
        nonlocal cur
        if cur is not None:
            blocks.append((cur["line"], cur["prose"], cur["rows"]))
        cur = None

    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            close()
            fence = not fence
            continue
        if fence:
            continue
        if stripped.startswith("|"):
            if cur is None:
                cur = {"line": n, "prose": "", "rows": [], "gap": False}
            cur["rows"].append(line)
        elif not stripped:
            if cur is not None and cur["prose"] and not cur["rows"]:
                cur["gap"] = True             # a caption waiting for its table
            else:
                close()
        elif stripped.startswith("#") or LIST_ITEM.match(line) or cur is None or cur["rows"] or cur["gap"]:
            close()
            if not stripped.startswith("#"):
                cur = {"line": n, "prose": stripped, "rows": [], "gap": False}
        else:
            cur["prose"] += " " + stripped
    close()
    return blocks


def check_readme(readme_text=None, perf_text=None):
    """The list of problems: README blocks with a figure and no link, links to no section, and
    figures missing from the sections their block links."""
    sections = perf_sections(perf_text)
    readme_text = _read(README) if readme_text is None else readme_text
    problems = []
    for anchor in ANY_PERF_LINK.findall(readme_text):
        if anchor not in sections:
            problems.append(f"README links docs/PERFORMANCE.md#{anchor}, which has no such section")
    for n, prose, rows in readme_blocks(readme_text):
        figures = figures_in(prose) + table_figures(rows)
        if not figures:
            continue
        anchors = [a for a in LINK.findall(prose) if a in sections]
        if not anchors:
            problems.append(f"README.md:{n}: figures {figures} with no link to a docs/PERFORMANCE.md section")
            continue
        body = "\n".join(sections[a][1] for a in anchors)
        for fig in figures:
            if not re.search(rf"(?<![\d.]){re.escape(fig)}(?![\d])", body):
                problems.append(f"README.md:{n}: {fig} is in none of the linked sections {anchors}")
    return problems


def check_perf(perf_text=None):
    perf_text = _read(PERF) if perf_text is None else perf_text
    problems = []
    sections = perf_sections(perf_text)
    for anchor in re.findall(r"\]\(#([\w.-]+)\)", perf_text):
        if anchor not in sections:
            problems.append(f"docs/PERFORMANCE.md links #{anchor}, which has no such section")
    for target in re.findall(r"\]\((?!#|https?:)([^)#]+)(?:#[^)]*)?\)", perf_text):
        if not os.path.exists(os.path.join(os.path.dirname(PERF), target)):
            problems.append(f"docs/PERFORMANCE.md links {target}, which does not exist")
    for anchor, (_, body) in sections.items():
        if not re.search(r"^\s*\|.*\|\s*$\n^\s*\|[\s:|-]+\|\s*$", body, re.M):
            continue                                   # no table: an introduction
        if not re.search(r"^Command(?: \([^)]*\))?:", body, re.M):
            problems.append(f"#{anchor}: no 'Command:' line")
        elif not re.search(r"^Command[^\n]*:\s*\n\n    \S", body, re.M) and \
                not re.search(r"^Command: not recorded", body, re.M):
            problems.append(f"#{anchor}: 'Command:' is followed by no indented command")
        if not re.search(r"^Date: \d{4}-\d{2}-\d{2}", body, re.M):
            problems.append(f"#{anchor}: no 'Date: YYYY-MM-DD' line")
        if not re.search(r"^Device: \S", body, re.M):
            problems.append(f"#{anchor}: no 'Device:' line")
        if not re.search(r"^Commit: (`[0-9a-f]{7,40}`|not recorded)", body, re.M):
            problems.append(f"#{anchor}: no 'Commit: `hash`' (or 'not recorded') line")
        header_has_mfu = any(re.match(r"^\s*\|.*\bMFU\b.*\|\s*$", line) for line in body.splitlines())
        if header_has_mfu and not re.search(r"^MFU: \S", body, re.M):
            problems.append(f"#{anchor}: an MFU column and no 'MFU:' line naming the denominator")
    return problems


def test_readme_figures_link_to_their_performance_tables():
    problems = check_readme()
    assert not problems, "\n".join(problems)


def test_performance_tables_state_command_date_device_commit():
    problems = check_perf()
    assert not problems, "\n".join(problems)


def test_performance_commits_exist():
    """Each commit named in docs/PERFORMANCE.md is one of this repository's (where git and the
    full history are here)."""
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("no git")
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git checkout")
    commits = set(re.findall(r"`([0-9a-f]{7,40})`", _read(PERF)))
    missing = [c for c in sorted(commits)
               if subprocess.run(["git", "cat-file", "-e", f"{c}^{{commit}}"], cwd=ROOT,
                                 capture_output=True, timeout=30).returncode != 0]
    assert not missing, f"docs/PERFORMANCE.md names commits this repository lacks: {missing}"


def test_the_check_catches_an_unlinked_figure():
    """A figure planted without a link, or with a link to a table that lacks it, is reported."""
    readme = _read(README)
    planted = readme + "\n- A new speed-up, 1.234× torch.compile, on one H200.\n"
    assert any("1.234" in p for p in check_readme(planted))
    linked = readme + "\n- 9.876 ms a step ([table](docs/PERFORMANCE.md#fusedadamw-h200)).\n"
    assert any("9.876" in p for p in check_readme(linked))
    table = readme + "\nCaption ([table](docs/PERFORMANCE.md#fusedadamw-h200)):\n\n| a | ms |\n|---|---:|\n| x | 12.10 |\n| y | 55.55 |\n"
    problems = check_readme(table)
    assert any("55.55" in p for p in problems) and not any("12.10" in p for p in problems)


def test_the_check_catches_a_table_without_its_provenance():
    perf = _read(PERF) + "\n### new-table\n\nSomething measured.\n\n| row | ms | MFU |\n|---|---:|---:|\n| x | 1.0 | 50% |\n"
    problems = [p for p in check_perf(perf) if p.startswith("#new-table")]
    assert len(problems) == 5, problems      # command, date, device, commit, MFU denominator
