"""``fnebm.reuse_freed_memory``: a freed large block is reused without new page faults.

The setting is process-wide and the tests never undo it, so the measurement runs in child processes;
it counts minor page faults (``ru_minflt``), not time.
"""

import subprocess
import sys
import textwrap

import pytest

import fnebm
from fnebm import memory

# Each child allocates and fills a 40 MiB float32 tensor (about W1's 40 MB trace) four times and prints
# the fewest page faults of the last three, after the first has warmed the allocator.
_CHILD = textwrap.dedent(
    """
    import resource, sys
    import torch
    import fnebm
    if sys.argv[1] == "on":
        assert fnebm.reuse_freed_memory() is True
    n = 40 * 2**20 // 4

    def touch():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(n)
        x.fill_(1.0)
        del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    touch()
    print(min(touch() for _ in range(3)))
    """
)


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(memory._glibc() is None, reason="glibc malloc only (Linux)")
def test_a_freed_trace_sized_block_is_reused_without_page_faults():
    pages = 40 * 2**20 // 4096
    default = _faults("off")
    if default < pages // 2:  # transparent huge pages for every mapping, or another allocator
        pytest.skip(f"this process maps 40 MiB with {default} page faults by default: nothing to save")
    reused = _faults("on")
    assert reused < pages // 20, (default, reused)


def test_bad_limits_are_refused_before_anything_changes():
    with pytest.raises(TypeError, match="limit_bytes must be an int"):
        fnebm.reuse_freed_memory(1.5e9)
    with pytest.raises(TypeError, match="got bool"):
        fnebm.reuse_freed_memory(True)
    with pytest.raises(ValueError, match=r"limit_bytes must be in \[2\*\*20, 2\*\*31 - 1\]"):
        fnebm.reuse_freed_memory(2**31)
    with pytest.raises(ValueError, match="got 1000"):
        fnebm.reuse_freed_memory(1000)


def test_elsewhere_it_changes_nothing_and_says_so(monkeypatch):
    monkeypatch.setattr(memory, "_glibc", lambda: None)
    assert fnebm.reuse_freed_memory() is False
