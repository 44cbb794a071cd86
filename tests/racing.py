"""Writers racing on one storage: threads that ``put_atomic`` one name at the same moment."""

from __future__ import annotations

import threading
from typing import Any


def race_puts(storage: Any, name: str, n: int = 8, **put_options: Any) -> int:
    """``n`` threads each put ``name`` with their own bytes; returns the index of the one that
    won, after checking that every other got ``FileExistsError`` and that the stored bytes are
    the winner's."""
    results = [""] * n
    start = threading.Barrier(n)

    def put(i: int) -> None:
        start.wait()
        try:
            storage.put_atomic(name, f"writer {i}".encode() * 50, **put_options)
            results[i] = "won"
        except FileExistsError:
            results[i] = "refused"

    threads = [threading.Thread(target=put, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (winner,) = [i for i, r in enumerate(results) if r == "won"]
    assert results.count("refused") == n - 1, results
    assert storage.read(name) == f"writer {winner}".encode() * 50
    return winner
