"""The per-machine profile store: the best configuration found, remembered per machine and workload.

A profile is found by its key, :func:`autotune.fingerprint.profile_key` of the machine and the
workload; this module stores it. Two stores keep profiles, behind the :class:`ProfileStore` protocol:

- :class:`EmbeddedProfileStore` (the default): one JSON file per key, ``<cache dir>/profiles/<key>.json``,
  under the directory :func:`resolve_cache_dir` names. No database, no SQLAlchemy import: a cache hit
  is a file read.
- :class:`DatabaseProfileStore`: a table ``autotune_profiles`` in any database Optuna's RDB storage
  accepts (``postgresql://...``, ``sqlite:///path``), shared by every node that uses the same URL.

A password never leaves a store: the database store keeps its URL to itself and shows it masked
(:func:`mask_url`) in its ``location``, its repr and its messages, and every record is masked on the
way in and on the way out (:func:`mask_record`), so a profile written before passwords were masked
is shown without it too.

A bad entry (truncated JSON, another schema) is never an error: it is ignored with a
:class:`~autotune.exceptions.ProfileStoreWarning` and read as a miss, and the next tuning run replaces
it. A store that cannot be written (read-only folder, full disk) warns and ``put`` returns ``False``:
the tuning result is still used, it is only not remembered.

# NOTE [ Atomic profile writes ]
# A profile file is written to a temporary file in the same folder (named TMP_PREFIX + pid + random),
# flushed and fsync'ed, then renamed over the target with os.replace, which is atomic on POSIX and
# Windows when source and target share a filesystem. Readers therefore see the old file or the new
# one, never a mix, and concurrent writers of one key end with exactly one of their records (the
# last rename wins). On any failure the temporary file is removed before the error is reported.
# The database store gets the same guarantee from one upsert per transaction.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
import re
import secrets
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .exceptions import ConfigurationError, ProfileStoreError, ProfileStoreWarning

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

SCHEMA_VERSION = 1
"""Version of the stored record layout. A record with any other version is ignored (and replaced)."""

CACHE_DIR_ENV = "AUTOTUNE_CACHE_DIR"
"""Environment variable that overrides the platform's user cache directory."""

APP_NAME = "autotune"

PROFILES_SUBDIR = "profiles"
"""Folder, inside the cache directory, that holds one ``<key>.json`` per profile."""

STUDIES_DB = "studies.db"
"""SQLite file, inside the cache directory, that keeps each tuning run's Optuna study."""

TMP_PREFIX = ".tmp-"
"""Prefix of the temporary files a write renames into place (see NOTE [ Atomic profile writes ])."""

STALE_TMP_S = 3600.0
"""A temporary file older than this was left by a killed writer; ``clear`` removes it."""

TABLE_NAME = "autotune_profiles"
"""The table the database store keeps profiles in, next to Optuna's own tables."""

POSTGRES_CONNECT_TIMEOUT_S = 10
"""Seconds to wait for a PostgreSQL server before calling it unreachable (unless the URL says)."""

_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

# Entries already warned about in this process, so each bad file or row warns once (per version of
# it: a file rewritten and corrupt again warns again).
_warned: set[tuple[str, ...]] = set()


# --------------------------------------------------------------------------------------------------
# Cache directory


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder profiles and studies live in, resolved now (no state is kept between calls).

    In order: the ``cache_dir`` argument; the ``AUTOTUNE_CACHE_DIR`` environment variable; the
    platform's user cache directory: ``$XDG_CACHE_HOME/autotune`` or ``~/.cache/autotune`` on Linux,
    ``~/Library/Caches/autotune`` on macOS, ``%LOCALAPPDATA%\\autotune\\Cache`` on Windows.
    The folder is not created here.
    """
    if cache_dir is not None and str(cache_dir) != "":
        return Path(cache_dir).expanduser().absolute()
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser().absolute()
    return _platform_cache_dir(sys.platform, os.environ).absolute()


def _platform_cache_dir(platform: str, environ: Mapping[str, str]) -> Path:
    home = Path(environ.get("HOME") or environ.get("USERPROFILE") or Path.home())
    if platform.startswith("win"):
        local = environ.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
        return Path(local) / APP_NAME / "Cache"
    if platform == "darwin":
        return home / "Library" / "Caches" / APP_NAME
    xdg = environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says a relative value is invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else home / ".cache"
    return base / APP_NAME


# --------------------------------------------------------------------------------------------------
# Stores


@runtime_checkable
class ProfileStore(Protocol):
    """Where profiles are kept. ``get`` and ``put`` never raise for a bad entry or a failed write."""

    location: str
    """Human-readable: a folder path, or a database URL with the password masked."""

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored record, passwords masked (:func:`mask_record`), or ``None`` when missing,
        corrupt or of another schema (with a warning)."""
        ...

    def put(self, key: str, record: Mapping[str, Any]) -> bool:
        """Store ``record`` under ``key`` atomically, passwords masked; ``True`` if written, ``False``
        (warned) if not."""
        ...

    def list(self) -> builtins.list[dict[str, Any]]:
        """One summary per readable profile, newest first (see :func:`summarize`)."""
        ...

    def delete(self, key: str) -> bool:
        """Remove one profile; ``True`` if it existed."""
        ...

    def clear(self) -> int:
        """Remove every profile; the number removed."""
        ...

    def study_storage_url(self) -> str:
        """The Optuna storage URL where tuning runs keep their studies, password included: for
        connecting only, never to be shown, logged or stored (:func:`mask_url` it first)."""
        ...

    def close(self) -> None:
        """Release connections (a no-op for the embedded store)."""
        ...


def open_store(
    *, cache_dir: str | os.PathLike[str] | None = None, storage: str | None = None
) -> ProfileStore:
    """The embedded store under the cache directory, or the database store when ``storage`` is a URL.

    Opening the embedded store touches nothing on disk. Opening a database store connects and creates
    the table if missing; an unreachable database raises :class:`ProfileStoreError`.
    """
    if storage:
        return DatabaseProfileStore(storage)
    return EmbeddedProfileStore(resolve_cache_dir(cache_dir))


def summarize(record: Mapping[str, Any]) -> dict[str, Any]:
    """The short form ``list`` returns: what a table of profiles shows."""
    workload = record.get("workload") or {}
    short_workload: dict[str, Any] = {}
    if isinstance(workload, Mapping):
        step = workload.get("step")
        short_workload = {
            "dataset": workload.get("dataset"),
            "len": workload.get("len"),
            "step": step.get("name") if isinstance(step, Mapping) else step,
            "device": workload.get("device"),
        }
    summary: dict[str, Any] = {
        "key": record.get("key"),
        "created": record.get("created"),
        "machine": record.get("machine"),
        "workload": short_workload,
        "loader_kwargs": record.get("loader_kwargs"),
    }
    if "samples_per_s" in record:
        summary["samples_per_s"] = record["samples_per_s"]
    return summary


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ConfigurationError(
            f"profile key {key!r} is not valid: a key is 1-128 letters, digits, '-' or '_', as"
            f" profile_key() returns; use a key shown by `autotune profiles list`."
        )
    return key


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _encode(key: str, record: Mapping[str, Any], *, indent: int | None = None) -> tuple[dict[str, Any], str]:
    """``record`` as it is stored (masked, with schema, key and creation time) and as JSON text."""
    stamped = mask_record(record)
    stamped["schema"] = SCHEMA_VERSION
    stamped["key"] = key
    stamped["created"] = record.get("created") or _now()
    try:
        return stamped, json.dumps(stamped, indent=indent, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise ProfileStoreError(
            f"the profile for key {key} cannot be stored: {err}; a record must hold only JSON"
            f" values (dict, list, str, int, float, bool, None)."
        ) from err


def _validate(record: Any, key: str) -> str | None:
    """Why a decoded record cannot be used, or ``None`` when it can."""
    if not isinstance(record, dict):
        return f"it holds a JSON {type(record).__name__}, not an object"
    schema = record.get("schema")
    if schema != SCHEMA_VERSION:
        return f"it has schema {schema!r} and this version of autotune reads schema {SCHEMA_VERSION}"
    if record.get("key", key) != key:
        return f"it holds the profile of key {record.get('key')!r}"
    return None


def _summaries(store: ProfileStore, keys: Iterable[str]) -> list[dict[str, Any]]:
    """The readable profiles among ``keys``, newest first (bad entries are skipped with a warning)."""
    summaries = []
    for key in keys:
        record = store.get(key)
        if record is not None:
            summaries.append(summarize(record))
    summaries.sort(key=lambda s: str(s.get("created") or ""), reverse=True)
    return summaries


def _decode(
    data: Any, key: str, where: str, identity: tuple[str, ...], *, row_schema: Any = SCHEMA_VERSION
) -> dict[str, Any] | None:
    """A stored record parsed and checked, or ``None`` with a warning (once) saying why not."""
    try:
        record = json.loads(data)
    except (TypeError, ValueError) as err:  # truncated or garbled JSON, bytes that are not UTF-8
        _warn_once(
            identity,
            f"ignoring the corrupt profile {where} ({err}); it will be replaced by the next tuning"
            f" run, or remove it with `autotune profiles clear`.",
        )
        return None
    reason = _validate(record, key)
    if reason is None and row_schema != SCHEMA_VERSION:
        reason = f"its row has schema {row_schema} and this version reads {SCHEMA_VERSION}"
    if reason is not None:
        _warn_once(
            identity,
            f"ignoring the profile {where}: {reason}. It will be replaced by the next tuning run,"
            f" or remove it with `autotune profiles clear`.",
        )
        return None
    return mask_record(record)


def _user_stacklevel() -> int:
    """The stacklevel that points a warning issued by this module's caller at the user's code."""
    package_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package_dir):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _warn_once(identity: tuple[str, ...], message: str) -> None:
    if identity in _warned:
        return
    _warned.add(identity)
    warnings.warn(message, ProfileStoreWarning, stacklevel=_user_stacklevel())


def _warn(message: str) -> None:
    warnings.warn(message, ProfileStoreWarning, stacklevel=_user_stacklevel())


class EmbeddedProfileStore:
    """One JSON file per profile under ``<cache dir>/profiles``; see NOTE [ Atomic profile writes ]."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.cache_dir = Path(cache_dir)
        self.profiles_dir = self.cache_dir / PROFILES_SUBDIR
        self.location = str(self.profiles_dir)

    def __repr__(self) -> str:
        return f"EmbeddedProfileStore({self.location!r})"

    def path(self, key: str) -> Path:
        """The file that holds ``key``'s profile (whether or not it exists)."""
        return self.profiles_dir / f"{_check_key(key)}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        path = self.path(key)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
                stat = os.fstat(fh.fileno())
        except FileNotFoundError:
            return None
        except OSError as err:
            _warn_once(
                ("read-error", str(path), type(err).__name__),
                f"could not read the profile {path}: {err}. It is treated as missing; check the"
                f" folder's permissions or point {CACHE_DIR_ENV} at a readable folder.",
            )
            return None
        identity = ("bad-file", str(path), str(stat.st_mtime_ns), str(stat.st_size))
        return _decode(data, key, str(path), identity)

    def put(self, key: str, record: Mapping[str, Any]) -> bool:
        path = self.path(key)
        _, text = _encode(key, record, indent=2)
        data = text.encode("utf-8")
        try:
            self.profiles_dir.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, data)
        except OSError as err:
            hint = (
                "free some disk space"
                if err.errno in (errno.ENOSPC, errno.EDQUOT)
                else f"make the folder writable or point {CACHE_DIR_ENV} at a writable folder"
            )
            _warn(
                f"could not save the profile to {path}: {err}. This run's result is still used but"
                f" will not be remembered; {hint}."
            )
            return False
        return True

    def list(self) -> builtins.list[dict[str, Any]]:
        return _summaries(self, self._keys())

    def delete(self, key: str) -> bool:
        path = self.path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as err:
            raise ProfileStoreError(
                f"could not delete the profile {path}: {err}; make the folder writable and retry."
            ) from err
        return True

    def clear(self) -> int:
        removed = sum(self.delete(key) for key in self._keys())
        self._remove_stale_temp_files()
        return removed

    def study_storage_url(self) -> str:
        with contextlib.suppress(OSError):  # an unwritable folder fails later, in Optuna, with a reason
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(self.cache_dir / STUDIES_DB).as_posix()}"

    def close(self) -> None:
        pass

    def _keys(self) -> builtins.list[str]:
        try:
            names = os.listdir(self.profiles_dir)
        except FileNotFoundError:
            return []
        except OSError as err:
            raise ProfileStoreError(
                f"could not list the profiles in {self.profiles_dir}: {err}; check the folder's"
                f" permissions or point {CACHE_DIR_ENV} at another folder."
            ) from err
        keys = []
        for name in sorted(names):
            stem, ext = os.path.splitext(name)
            if ext == ".json" and not name.startswith(TMP_PREFIX) and _KEY_RE.match(stem):
                keys.append(stem)
        return keys

    def _remove_stale_temp_files(self) -> None:
        try:
            names = os.listdir(self.profiles_dir)
        except OSError:
            return
        cutoff = time.time() - STALE_TMP_S
        for name in names:
            if name.startswith(TMP_PREFIX):
                path = self.profiles_dir / name
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < cutoff:
                        path.unlink()


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never a part."""
    tmp = path.parent / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}.json"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    fd = os.open(tmp, flags, 0o666)  # the umask decides the final permissions
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        _replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _replace(src: Path, dst: Path) -> None:
    # On Windows, os.replace fails while another process has the target open; readers are brief.
    for attempt in range(10):
        try:
            os.replace(src, dst)
            return
        except PermissionError:
            if os.name != "nt" or attempt == 9:
                raise
            time.sleep(0.01 * (attempt + 1))


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (POSIX); best effort, the file is already complete."""
    if os.name == "nt":
        return
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class DatabaseProfileStore:
    """Profiles in the table ``autotune_profiles`` of a SQL database Optuna can also keep studies in.

    Uses SQLAlchemy Core, imported only when this store is opened. One row per key; writes are one
    upsert in one transaction, so nodes writing the same key at once leave one consistent row.
    """

    def __init__(self, url: str) -> None:
        try:
            import sqlalchemy as sa
            from sqlalchemy.engine import make_url
        except ImportError as err:  # pragma: no cover - SQLAlchemy comes with Optuna
            raise ProfileStoreError(
                f"storage={mask_url(url)!r} needs SQLAlchemy, which is not installed; run"
                f" `pip install sqlalchemy` or omit storage= to use the embedded store."
            ) from err
        self._sa = sa
        try:
            parsed = make_url(url)
        except Exception as err:  # sqlalchemy.exc.ArgumentError, ValueError
            shown = mask_url(url)
            if "://" not in url and "@" in url:  # no URL: a password may stand where mask_url won't look
                shown = f"{MASK}@{url.rsplit('@', 1)[1]}"
            raise ConfigurationError(
                f"storage={shown!r} is not a database URL; use one such as"
                f" 'postgresql://user:password@host/dbname' or 'sqlite:////path/to/profiles.db'."
            ) from err
        self.location = mask_url(parsed.render_as_string(hide_password=True))
        self._secrets = _url_secrets(parsed)
        resolved = _with_installed_driver(parsed)
        self._url = url if resolved is parsed else resolved.render_as_string(hide_password=False)
        parsed = resolved
        self._engine = self._create_engine(parsed)
        self._table = self._define_table()
        self._create_table()

    def __repr__(self) -> str:
        return f"DatabaseProfileStore({self.location!r})"

    # -- setup ------------------------------------------------------------------------------------

    def _create_engine(self, parsed: Any) -> Engine:
        sa = self._sa
        connect_args: dict[str, Any] = {}
        if parsed.get_backend_name() == "postgresql" and "connect_timeout" not in parsed.query:
            connect_args["connect_timeout"] = POSTGRES_CONNECT_TIMEOUT_S
        try:
            # No pool: a store does a handful of operations per tuning run, and a pooled connection
            # would stay open until the garbage collector finds a store nobody closed.
            return sa.create_engine(parsed, connect_args=connect_args, poolclass=sa.pool.NullPool)
        except ImportError as err:  # the DBAPI driver is missing
            backend = parsed.get_backend_name()
            fix = (
                "pip install 'dataloader-autotune[postgres]'"
                if backend == "postgresql"
                else f"install the Python driver for {parsed.drivername}"
            )
            raise ProfileStoreError(
                f"cannot open the profile store {self.location}: the database driver for"
                f" {parsed.drivername!r} is not installed ({self._mask(str(err))}); run `{fix}`,"
                f" or omit storage= to use the embedded store."
            ) from err
        except Exception as err:  # sqlalchemy.exc.NoSuchModuleError, ArgumentError
            raise ConfigurationError(
                f"storage={self.location!r} names a database SQLAlchemy cannot open"
                f" ({self._mask(str(err))}); use a"
                f" URL such as 'postgresql://user:password@host/dbname' or 'sqlite:////path/db'."
            ) from err

    def _define_table(self) -> Any:
        sa = self._sa
        # MySQL cannot index an unbounded TEXT key; every other backend keeps TEXT.
        key_type = sa.Text().with_variant(sa.String(128), "mysql", "mariadb")
        return sa.Table(
            TABLE_NAME,
            sa.MetaData(),
            sa.Column("key", key_type, primary_key=True),
            sa.Column("schema", sa.Integer, nullable=False),
            sa.Column("created", sa.Text, nullable=False),
            sa.Column("updated", sa.Text, nullable=False),
            sa.Column("record", sa.Text, nullable=False),
        )

    def _create_table(self) -> None:
        sa = self._sa
        try:
            try:
                self._table.create(self._engine, checkfirst=True)
            except sa.exc.DBAPIError as err:
                # Another process created it between our check and our CREATE: fine if it is there.
                if err.connection_invalidated or not sa.inspect(self._engine).has_table(TABLE_NAME):
                    raise
        except sa.exc.SQLAlchemyError as err:
            self._engine.dispose()
            raise self._error("connect to the database and create the profile table", err) from err

    def _error(self, action: str, err: BaseException) -> ProfileStoreError:
        detail = self._mask(str(getattr(err, "orig", None) or err)).strip().splitlines()
        engine = getattr(self, "_engine", None)
        if engine is not None and engine.dialect.name == "sqlite":
            check = ("Check that the file is a SQLite database (a damaged one can be removed, and is"
                     " made again) and that its folder exists and is writable")
        else:
            check = ("Check that the database server is running and reachable from this machine and"
                     " that the URL, user, password and database name are right")
        return ProfileStoreError(
            f"could not {action} in {self.location}: {detail[0] if detail else type(err).__name__}."
            f" {check}, or omit storage= to use the embedded store."
        )

    def _mask(self, text: str) -> str:
        """``text`` with this store's password masked, in a URL or standing alone (a driver's DSN)."""
        text = mask_url(text)
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return text

    # -- the store --------------------------------------------------------------------------------

    def get(self, key: str) -> dict[str, Any] | None:
        sa = self._sa
        _check_key(key)
        table = self._table
        try:
            with self._engine.connect() as conn:
                row = conn.execute(
                    sa.select(table.c.schema, table.c.updated, table.c.record).where(table.c.key == key)
                ).first()
        except sa.exc.SQLAlchemyError as err:
            _warn(f"{self._error('read the profile ' + key, err)} It is treated as missing.")
            return None
        if row is None:
            return None
        identity = ("bad-row", self.location, key, str(row.updated))
        return _decode(row.record, key, f"{key} in {self.location}", identity, row_schema=row.schema)

    def put(self, key: str, record: Mapping[str, Any]) -> bool:
        sa = self._sa
        _check_key(key)
        stamped, text = _encode(key, record)
        values = {
            "key": key,
            "schema": SCHEMA_VERSION,
            "created": stamped["created"],
            "updated": _now(),
            "record": text,
        }
        try:
            self._upsert(values)
        except sa.exc.SQLAlchemyError as err:
            _warn(
                f"{self._error('save the profile ' + key, err)} This run's result is still used"
                f" but will not be remembered."
            )
            return False
        return True

    def _upsert(self, values: dict[str, Any]) -> None:
        sa = self._sa
        table = self._table
        changes = {k: v for k, v in values.items() if k != "key"}
        dialect = self._engine.dialect.name
        if dialect in ("postgresql", "sqlite"):
            from sqlalchemy.dialects import postgresql, sqlite

            insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
            stmt = insert(table).values(**values)
            upsert = stmt.on_conflict_do_update(index_elements=[table.c.key], set_=changes)
            with self._engine.begin() as conn:
                conn.execute(upsert)
            return
        if dialect in ("mysql", "mariadb"):
            from sqlalchemy.dialects.mysql import insert as mysql_insert

            mstmt = mysql_insert(table).values(**values).on_duplicate_key_update(**changes)
            with self._engine.begin() as conn:
                conn.execute(mstmt)
            return
        # Any other backend: update, else insert; a concurrent insert of the same key makes ours
        # fail with IntegrityError, and the retry then updates the row the other writer created.
        for attempt in range(3):
            try:
                with self._engine.begin() as conn:
                    updated = conn.execute(
                        sa.update(table).where(table.c.key == values["key"]).values(**changes)
                    )
                    if updated.rowcount == 0:
                        conn.execute(sa.insert(table).values(**values))
                return
            except sa.exc.IntegrityError:
                if attempt == 2:
                    raise

    def list(self) -> builtins.list[dict[str, Any]]:
        sa = self._sa
        try:
            with self._engine.connect() as conn:
                keys = [row.key for row in conn.execute(sa.select(self._table.c.key))]
        except sa.exc.SQLAlchemyError as err:
            raise self._error("list the profiles", err) from err
        return _summaries(self, [k for k in keys if _KEY_RE.match(str(k))])

    def delete(self, key: str) -> bool:
        sa = self._sa
        _check_key(key)
        try:
            with self._engine.begin() as conn:
                result = conn.execute(sa.delete(self._table).where(self._table.c.key == key))
        except sa.exc.SQLAlchemyError as err:
            raise self._error(f"delete the profile {key}", err) from err
        return bool(result.rowcount)

    def clear(self) -> int:
        sa = self._sa
        try:
            with self._engine.begin() as conn:
                result = conn.execute(sa.delete(self._table))
        except sa.exc.SQLAlchemyError as err:
            raise self._error("clear the profiles", err) from err
        return int(result.rowcount)

    def study_storage_url(self) -> str:
        """The URL with its password, for Optuna to connect with: never to be shown or stored."""
        return self._url

    def close(self) -> None:
        self._engine.dispose()


def _with_installed_driver(parsed: Any) -> Any:
    """A bare ``postgresql://`` URL with its driver made explicit when the default one is missing.

    SQLAlchemy's default PostgreSQL driver differs between versions (psycopg2 up to 2.0, psycopg 3
    from 2.1); a bare URL then fails although the other driver is installed. Naming the installed
    driver lets this store and Optuna, which receives the same URL, open the database either way.
    """
    if parsed.drivername != "postgresql":
        return parsed
    try:
        default = parsed.get_dialect().driver
    except Exception:  # an unknown dialect is reported when the engine is created
        return parsed
    if _importable(default):
        return parsed
    for driver in ("psycopg2", "psycopg"):
        if _importable(driver):
            return parsed.set(drivername=f"postgresql+{driver}")
    return parsed


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


MASK = "***"
"""What a password is shown as (SQLAlchemy's own mask, so both renderings of a URL agree)."""

_PASSWORD_RE = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")
_QUERY_PASSWORD_RE = re.compile(r"([?&]password=)[^&\s'\"]*", re.IGNORECASE)


def mask_url(url: str) -> str:
    """``url`` (or any text holding one) with its password replaced by ``***``.

    Both places a database URL can carry one are masked: ``user:password@host`` and a
    ``?password=`` query parameter (libpq reads it there too).
    """
    return _QUERY_PASSWORD_RE.sub(rf"\1{MASK}", _PASSWORD_RE.sub(rf"\1{MASK}@", url))


def mask_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``record`` with :func:`mask_url` applied to every string in it, however nested."""
    return {k: _mask_strings(v) for k, v in record.items()}


def _mask_strings(value: Any) -> Any:
    if isinstance(value, str):
        return mask_url(value)
    if isinstance(value, Mapping):
        return {k: _mask_strings(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mask_strings(v) for v in value]
    return value


def _url_secrets(parsed: Any) -> tuple[str, ...]:
    """The password of a parsed URL as it may appear in a message: decoded, URL-encoded, or query."""
    from urllib.parse import quote

    found = [parsed.password, parsed.query.get("password")]
    texts = {str(p) for p in found if p and isinstance(p, str)}
    return tuple(sorted(texts | {quote(t, safe="") for t in texts}, key=len, reverse=True))
