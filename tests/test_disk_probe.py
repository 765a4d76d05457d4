"""bench/store_contenders.py's raw disk probe: its footprint diagnostics land each request in the next buffer in
turn and write blocks that differ from each other and from one call to the next."""

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from store_contenders import DiskProbe, Method  # noqa: E402

BLOCK = 64 * 1024


def _blocks(path: str) -> list[bytes]:
    data = Path(path).read_bytes()
    return [data[i:i + BLOCK] for i in range(0, len(data), BLOCK)]


def test_footprint_lands_requests_in_buffers_in_turn(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        probe = DiskProbe(str(tmp_path), size=5 * BLOCK, block=BLOCK, depth=2, pool=pool)
        try:
            calls = probe.footprint(3)
            if not probe.direct:  # a file system without O_DIRECT: no diagnostics, nothing else changes
                assert calls == {}
                return
            names = sorted(calls)
            assert len(names) == 2 and all("3 buffers in turn (diagnostic)" in n for n in names)
            assert not set(names) & set(probe.by_name), "diagnostics must not be candidates for the floor"
            read = next(calls[n] for n in names if n.startswith("raw disk read"))
            write = next(calls[n] for n in names if n.startswith("raw disk write"))

            probe.run(Method(True, True))  # the write file, rewritten in place below
            write()
            first = _blocks(probe.path)
            assert len(first) == 5 and len(set(first)) == 5, "every block written must differ"
            write()
            second = _blocks(probe.path)
            assert all(a != b for a, b in zip(first, second)), "each call writes new bytes"

            probe.refresh()
            read()
            blocks = _blocks(probe.read_path)
            # Five requests into three buffers: the last request into each buffer is what it holds.
            for buffer, block in zip(probe._footprint, (blocks[3], blocks[4], blocks[2])):
                assert bytes(buffer[:BLOCK]) == block
        finally:
            probe.close()
