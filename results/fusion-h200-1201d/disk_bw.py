"""Raw read rate of a machine's disk with the page cache dropped: 2 MB ``preadv`` calls from 1-16 threads,
with and without ``POSIX_FADV_WILLNEED`` over the whole file. The bound a disk-tier fused pass can reach.

Usage: python3 disk_bw.py FILE   (FILE: a 1 GiB scratch file, written first where missing; remove it after)
"""

from __future__ import annotations

import os
import sys
import threading
import time

SIZE = 1 << 30
CHUNK = 2 << 20  # one layer of one 512-token chunk of a Mistral-7B-shaped model in bf16


def write(path: str) -> None:
    with open(path, "wb") as f:
        for _ in range(SIZE // (64 << 20)):
            f.write(os.urandom(64 << 20))
        f.flush()
        os.fsync(f.fileno())


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def rate(path: str, threads: int, advise: bool) -> float:
    """GB/s reading the whole file, each thread its own contiguous share."""
    drop(path)
    fd = os.open(path, os.O_RDONLY)
    if advise:
        os.posix_fadvise(fd, 0, SIZE, os.POSIX_FADV_WILLNEED)
    share = SIZE // threads

    def read_share(i: int) -> None:
        buf = memoryview(bytearray(CHUNK))
        offset = i * share
        while offset < (i + 1) * share:
            offset += os.preadv(fd, [buf], offset)

    t = time.perf_counter()
    workers = [threading.Thread(target=read_share, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t
    os.close(fd)
    return SIZE / seconds / 1e9


def main() -> None:
    path = sys.argv[1]
    if not os.path.exists(path):
        write(path)
    for threads in (1, 2, 4, 8, 16):
        print(f"threads {threads}: {rate(path, threads, False):.2f} GB/s; "
              f"with WILLNEED on the whole file {rate(path, threads, True):.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
