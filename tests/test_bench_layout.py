"""The benchmarks use nsp's public API only, and the report's freshness rules name files that exist."""

import ast
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _private_nsp_imports(path: Path) -> list[str]:
    """``nsp`` names starting with an underscore that ``path`` imports (modules or the names taken from them)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            names = []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            names = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "nsp" and (any(p.startswith("_") for p in parts)
                                      or any(n.startswith("_") for n in names)):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_bench_imports_no_private_nsp_name():
    scripts = sorted(BENCH.glob("*.py"))
    assert scripts
    private = [hit for path in scripts for hit in _private_nsp_imports(path)]
    assert not private, "bench/ reaches into nsp's private names:\n" + "\n".join(private)


def test_bench_modules_have_public_names():
    assert not [p.name for p in BENCH.glob("_*.py")]


def test_every_path_the_freshness_rules_name_exists():
    # A path that no longer exists would leave its records fresh whatever changes: git diff sees nothing there.
    code = ("import json, sys; sys.argv = ['report.py']; sys.path.insert(0, 'bench'); import report; "
            "print(json.dumps(report.MEASURES))")
    root = BENCH.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    measures = json.loads(out.stdout.strip().splitlines()[-1])
    missing = sorted({p for paths in measures.values() for p in paths if not (root / p).exists()})
    assert not missing, f"bench/report.py's MEASURES names paths that do not exist: {missing}"
