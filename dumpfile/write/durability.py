"""What keeps a dump file openable whatever fails: disk space claimed before HDF5 writes,
the disk-space reserve, and the first failed write freezing the file at its last flush.

`DurableFile` is DumpWriter's base (writer.py): DumpWriter makes the objects and the
rows that describe them; this class flushes them (at least every half `flush_interval`
while ops arrive, the op count only after what it counts), makes sure a flush either
writes nothing or completes (`_claim_to_eoa` before it), that after a failure nothing
more reaches the file (`fail`), and closes the file. docs/FORMAT.md, "Durability", says
why each step is there. It works on what the writer holds: the open file `_f`, its raw
descriptor `_fd`, `path`, `num_ops`, `flush_interval`, and `_publish_rows()` /
`_tables()` (the rows not yet in the tables, and the tables).
"""

from __future__ import annotations

import os
import re
import time

from h5py import h5a

from .. import schema as S
from ..errors import DumpWriteError
from .h5objects import (METADATA_CACHE_BYTES, _TEST_WRITE_DELAY_S, _claimed_only, _first_line,
                        _os_error, claim_blocks, rewrite_scalar_attr, stored_row_bytes)

# Metadata HDF5 keeps cached after a flush once the cache holds more than
# CLEAN_METADATA_DROP_ABOVE (least recently used dropped first). Why: HDF5 (2.0) walks
# every cached entry at each flush to list the dirty ones, so a cache left to fill its
# METADATA_CACHE_BYTES (~130k entries) made each flush slower as the dump grew: 0.05 ms
# per op at 5k ops, 0.15 at 50k (op groups, a small dataset and a link per op, a flush
# every 300 ops; 0.04 -> 0.37 flushing every 100). After a flush every entry is clean, so
# dropping them writes nothing; the hot ones (the root, the op name groups, the index) are
# the most recently used and stay. Dropping at every flush cost more re-reads for no gain.
CLEAN_METADATA_KEPT_BYTES = 2 << 20

# What a flush allocates past the end of allocation besides the tables' new chunks: the
# chunk indexes' nodes, object header continuations, the free-space bookkeeping
FLUSH_METADATA_ROOM = 8 << 10
CLEAN_METADATA_DROP_ABOVE = 8 << 20


def drop_clean_metadata(f) -> None:
    """Past CLEAN_METADATA_DROP_ABOVE, shrink HDF5's metadata cache to
    CLEAN_METADATA_KEPT_BYTES and set it back to its fixed size (h5objects.
    _keep_dirty_metadata). Call only right after a completed flush: the entries dropped
    must all be clean."""
    try:
        if f.id.get_mdc_size()[2] <= CLEAN_METADATA_DROP_ABOVE:
            return
        c = f.id.get_mdc_config()
    except Exception:  # noqa: BLE001 - an older HDF5: nothing to drop
        return
    try:
        c.set_initial_size = True
        c.initial_size = CLEAN_METADATA_KEPT_BYTES
        c.min_size = min(c.min_size, CLEAN_METADATA_KEPT_BYTES)
        f.id.set_mdc_config(c)
        h5a.exists(f.id, S.ROOT_NUM_OPS.encode())   # (HDF5 evicts at the next cache access)
    except Exception:  # noqa: BLE001 - the cache as it was: only slower flushes
        pass
    finally:
        # never leave it small: a full cache writes dirty entries between flushes
        c.initial_size = c.max_size = METADATA_CACHE_BYTES
        f.id.set_mdc_config(c)


class DurableFile:
    _failed: DumpWriteError | None = None   # (set per instance by fail())
    _frozen = False     # (fail(): HDF5's descriptor points at /dev/null)
    _flushed_rows: dict = {}    # table path -> rows at the last flush (_flush_headroom)
    _claim_blocks = True    # until the file system says it cannot (fallocate)
    _reserve: str | None = None     # the reserve file's path
    _bytes = None       # the tensor-byte writer (direct_io.TensorBytes) on the second descriptor

    # ---- flushes -------------------------------------------------------------------------
    def maybe_flush(self) -> None:
        if _TEST_WRITE_DELAY_S:
            time.sleep(_TEST_WRITE_DELAY_S)
        # Half the interval while ops arrive: with the dumper's writers keeping at most
        # 0.4 of it unwritten (WriterThread.max_lag), every op recorded a whole
        # flush_interval before a kill is in the file (docs/FORMAT.md, "Durability").
        # Each flush writes what changed since the last, so twice as many cost little more.
        if time.monotonic() - self._last_flush >= self.flush_interval * 0.5:
            self.flush()

    def flush(self, *, final: bool = False) -> None:
        """Make every finished op durable: index rows, HDF5 flush, then the op count and
        another flush. `num_ops` on disk thus counts only ops a completed flush wrote: a
        SIGKILL inside a flush (writer="thread") can leave that flush's own structures half
        written (dumpfile.read.recovery reads around them), never an op count ahead of them.
        `final` (at close, where `complete` follows): one flush.

        The disk space the flush will write to is claimed first (up to HDF5's end of
        allocation): a full disk or a file-size limit then shows before HDF5 writes
        anything, and the file stays as the last flush left it (see fail())."""
        if self._failed is not None and (self._frozen or not final):
            raise self._failed
        try:
            self._publish_rows()
            self._claim_to_eoa()
            if self._unflushed and not final:
                self._f.flush()
            self._unflushed = False
            rewrite_scalar_attr(self._f, S.ROOT_NUM_OPS, self.num_ops)
            self._f.flush()
        except (OSError, RuntimeError) as e:  # disk full surfaces here (h5py: RuntimeError)
            raise self.fail(e) from e
        self.durable_ops = self.num_ops
        if not final:
            drop_clean_metadata(self._f)
        self._note_flushed_rows()
        self._last_flush = time.monotonic()

    # ---- disk space claimed before a flush ----------------------------------------------
    def _claim_to_eoa(self, *, closing: bool = False) -> None:
        """Allocate the file's blocks up to HDF5's end of allocation (what the coming flush
        writes stays below it). Raises OSError (ENOSPC, EFBIG past a file-size limit).

        The file grows to that end (and the headroom past it) while HDF5 writes it: a
        kill inside the flush then still leaves a file as long as the end of allocation
        its superblock may already record. `closing`: the claim before HDF5's close, see
        close()."""
        try:
            fd = self._f.id.get_vfd_handle()
            eoa = self._f.id.get_filesize()     # max(end of file, end of allocation)
        except Exception:  # noqa: BLE001 - not a plain POSIX file: nothing to claim
            return
        if not isinstance(fd, int) or fd < 0:
            return
        # and room past it: a flush also allocates (the chunks of the index and statistics
        # tables that HDF5's chunk cache still holds); a stats flush that failed there had
        # already written a superblock whose end of allocation the file never reached
        want = eoa + self._flush_headroom()
        size = os.fstat(fd).st_size
        if closing:
            # HDF5's own size first (the headroom claimed at the flushes goes), then the
            # blocks past it without growing the file (KEEP_SIZE)
            if size > eoa:
                os.ftruncate(fd, eoa)
                size = eoa
            if want > size and self._claim_blocks:
                if not claim_blocks(fd, size, want - size, keep_size=True):
                    self._claim_blocks = False
            return
        if want > size and self._claim_blocks:
            if not claim_blocks(fd, size, want - size):
                self._claim_blocks = False

    def _flush_headroom(self) -> int:
        """Room a flush may allocate past the end of allocation: the table chunks begun
        since the last flush, as stored, plus FLUSH_METADATA_ROOM (a fixed 2 MB filled a
        3 MB disk at once; one more chunk of every table, 172 KB for a statistics table,
        made the first flush claim more than a 256 KB file-size limit allowed and the file
        kept 0 ops: issue 32)."""
        n = FLUSH_METADATA_ROOM
        flushed = self._flushed_rows
        for ds in self._tables():
            if ds is not None and ds.chunks:
                rows, per = ds.shape[0], ds.chunks[0]
                new = -(-rows // per) - -(-flushed.get(ds.name, 0) // per)
                n += new * per * stored_row_bytes(ds.id.get_type())
        return n

    def _note_flushed_rows(self) -> None:
        self._flushed_rows = {ds.name: ds.shape[0] for ds in self._tables()
                              if ds is not None and ds.chunks}

    def _release_unused_blocks(self) -> None:
        """After HDF5's close: the blocks claimed past the file's end (close()'s claim,
        KEEP_SIZE) that HDF5 did not write. A truncate to the file's own size: the size
        and every byte stay as HDF5 left them (a reader may already have the file open)."""
        if self._fd >= 0:
            try:
                os.ftruncate(self._fd, os.fstat(self._fd).st_size)
            except OSError:
                pass

    # ---- write failures ---------------------------------------------------------------
    def fail(self, e: BaseException) -> DumpWriteError:
        """The first failed write (disk full, file-size limit, I/O error): stop writing
        this file and keep it exactly as the last completed flush left it, then return
        the one line to report (file, error, ops kept); later calls return the same.

        HDF5's descriptor (and the pwrite one) is pointed at /dev/null: nothing HDF5
        does afterwards (the close's flush, h5py's clean-up at interpreter exit) writes
        to the file. Letting HDF5 go on after a failed write left files that plain h5py
        did not open ("addr overflow", "truncated file"), each later call printed an
        "Exception ignored", and the thread writer segfaulted at exit. What was written
        since the last flush lies in space that flush's metadata does not reference.

        When only claiming space failed (SpaceClaimError: nothing was written, HDF5's state
        is intact), the file is not frozen yet: close() gives back the disk-space reserve
        and makes one last flush, space claimed first, of the ops completed so far (on a
        full 3 MB disk the first claim often failed before any op had been flushed)."""
        if self._failed is not None:      # a second failure (e.g. the last flush's claim)
            if not self._frozen:
                self._freeze()
            return self._failed
        ose = _os_error(e)
        code = ose.errno if ose is not None else None
        if code is None:        # HDF5's own message: "... errno = 27, error message = ..."
            m = re.search(r"errno = (\d+)", str(e))
            code = int(m.group(1)) if m else None
        what = f"[Errno {code}] {os.strerror(code)}" if code else _first_line(e)
        if what.startswith(self.path + ": "):
            what = what[len(self.path) + 2:]
        self._failed = DumpWriteError(f"{self.path}: write failed ({what[:300]})")
        if not _claimed_only(e):
            self._freeze()
        return self._failed

    def _freeze(self) -> None:
        self._frozen = True
        null = -1
        try:
            null = os.open(os.devnull, os.O_RDWR)
            fds = [self._fd] if self._fd >= 0 else []
            try:
                fd = self._f.id.get_vfd_handle()
                if isinstance(fd, int) and fd >= 0:
                    fds.append(fd)
            except Exception:  # noqa: BLE001 - not a POSIX file driver: nothing to point away
                pass
            for fd in fds:      # (dup2, not close: another thread may still pwrite to it)
                os.dup2(null, fd)
            if self._bytes is not None:     # (and its O_DIRECT descriptor)
                self._bytes.freeze(null)
        except OSError:
            pass
        finally:
            if null >= 0:
                os.close(null)
        self.release_reserve()

    @property
    def failed(self) -> DumpWriteError | None:
        return self._failed

    # ---- disk full --------------------------------------------------------------------
    def _make_reserve(self, nbytes: int) -> str | None:
        """Hold some disk space in a side file, given back when a write fails with ENOSPC
        so that the final metadata flush can still succeed and the file stays readable."""
        if nbytes <= 0:
            return None
        d, base = os.path.split(os.path.abspath(self.path))
        reserve = os.path.join(d, f".{base}.reserve")
        try:
            st = os.statvfs(d)
            nbytes = min(nbytes, st.f_bavail * st.f_frsize // 8)
            if nbytes <= 0:
                return None
            fd = os.open(reserve, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            try:
                os.unlink(reserve)
            except OSError:
                pass
            return None
        return reserve

    def release_reserve(self) -> None:
        if self._reserve is not None:
            try:
                os.unlink(self._reserve)
            except OSError:
                pass
            self._reserve = None

    # ---- the close -------------------------------------------------------------------------
    def close(self, complete: bool = True) -> None:
        """Flush, mark `complete`, close. After a failed write (fail()) the file is left as
        its last good flush wrote it, and this raises that failure's DumpWriteError."""
        if not self._f.id.valid:
            self.release_reserve()
            return
        if not complete:       # after a failure: give the space back first
            self.release_reserve()
        try:
            if not self._frozen:
                if self._failed is not None:
                    self.release_reserve()  # (room for the last flush, claimed first)
                self.flush(final=True)
                try:
                    rewrite_scalar_attr(self._f, S.ROOT_COMPLETE, bool(complete))
                    # The file's size set to HDF5's own here, while HDF5 holds its lock:
                    # HDF5's close truncates to its end of allocation only when its idea of
                    # the file's end differs from that end, so the headroom claimed at the
                    # flushes often stayed, and was cut after the close, when the lock was
                    # gone: a reader that had looked at the size meanwhile (dumpfile.read.
                    # recovery raises the end of allocation to it) then found the file
                    # shorter than that ("truncated file", issue 15). Nothing changes the
                    # file's size or bytes after HDF5 lets go of it.
                    self._claim_to_eoa(closing=True)
                except (OSError, RuntimeError) as e:
                    raise self.fail(e) from e
            if self._failed is not None:
                raise self._failed
        finally:
            try:
                self._f.close()
            except (OSError, RuntimeError):
                pass
            if not self._frozen:
                self._release_unused_blocks()
            self.release_reserve()
            if self._bytes is not None:
                self._bytes.close()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(complete=exc_type is None)

