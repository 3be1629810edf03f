"""A bounds-checked reader and a writer of MediaPipe ``.task`` bundles: zip archives of STORED members.

MediaPipe's Tasks API reads a bundle's members in place (a member is a byte range of the file), so nothing here
extracts a member to disk or reads one whole: a member is its name and where its bytes are. A zip is untrusted input,
so before any member is used: the end record and the central directory lie inside the file; every member is STORED
(method 0; MediaPipe refuses a compressed one), unencrypted, with equal stored and original sizes; its local header
agrees with its central entry (name, method, sizes); its data lies before the central directory and overlaps no other
member (so the bytes the members claim never exceed the file: no zip bomb); its name is a relative path without
``..``, backslashes or NUL, and no two members share a name. Zip64 and multi-disk archives are refused (MediaPipe's
bundles are small zips).

``write_bundle`` lays the same members, in the same order and with the same names, each at an aligned data offset:
the local header's extra field pads the header (Android zipalign's 0xD935 record) so that the member's first byte
lands on the boundary; the members' bytes are copied unchanged (checked against their CRC-32 while copied).
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from ...errors import InvalidModel, OutputError, Unsupported

_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory record
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory file header
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header
EOCD_SIG, CENTRAL_SIG, LOCAL_SIG = 0x06054B50, 0x02014B50, 0x04034B50
ZIP64_LOCATOR_SIG = 0x07064B50
STORED = 0
FLAG_ENCRYPTED, FLAG_DESCRIPTOR, FLAG_UTF8 = 0x1, 0x8, 0x800
ZIPALIGN_EXTRA = 0xD935  # Android zipalign's alignment record: u16 alignment, then zero padding
MAX_MEMBERS = 4096  # MediaPipe bundles hold a handful; more is refused before the directory is walked
MAX_NAME = 1024
CHUNK = 1 << 22


@dataclass(frozen=True)
class Member:
    """One stored member: where its local header and its bytes are in the bundle (nothing is read)."""

    name: str
    header_offset: int
    data_offset: int  # absolute position of the member's first byte
    size: int
    crc32: int
    flags: int
    mod_time: int
    mod_date: int
    external_attr: int
    version_made_by: int


@dataclass(frozen=True)
class Bundle:
    path: str
    size: int
    members: list[Member]
    comment: bytes


def _pread(fd: int, n: int, pos: int, what: str, path: str) -> bytes:
    data = os.pread(fd, n, pos)
    if len(data) != n:
        raise InvalidModel(f"not a valid .task bundle: the file ends inside {what} (offset {pos})", path)
    return data


def _end_record(fd: int, size: int, path: str) -> tuple[int, int, int, bytes]:
    """(central directory offset, its size, entry count, archive comment) from the end record, searched in the
    last 64 KiB + 22 bytes (a comment is at most 65535 bytes)."""
    tail_len = min(size, _EOCD.size + 0xFFFF)
    tail = _pread(fd, tail_len, size - tail_len, "the end record", path)
    at = tail.rfind(struct.pack("<I", EOCD_SIG))
    while at >= 0:
        if at + _EOCD.size <= len(tail):
            sig, disk, cd_disk, here, total, cd_size, cd_offset, comment_len = _EOCD.unpack_from(tail, at)
            if at + _EOCD.size + comment_len == len(tail):
                if disk or cd_disk or here != total:
                    raise Unsupported("a multi-disk zip is not a MediaPipe bundle", path)
                if 0xFFFF in (here, total) or 0xFFFFFFFF in (cd_size, cd_offset):
                    raise Unsupported("a zip64 archive is not supported for .task bundles", path)
                comment = tail[at + _EOCD.size :]
                return cd_offset, cd_size, total, comment
        at = tail.rfind(struct.pack("<I", EOCD_SIG), 0, at)
    raise InvalidModel("not a valid .task bundle: no zip end-of-central-directory record", path)


def _check_name(raw: bytes, flags: int, path: str) -> str:
    if not raw or len(raw) > MAX_NAME:
        raise InvalidModel(f"not a valid .task bundle: a member name of {len(raw)} bytes", path)
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        if flags & FLAG_UTF8:
            raise InvalidModel("not a valid .task bundle: a member name is not UTF-8", path) from None
        name = raw.decode("cp437")
    parts = PurePosixPath(name).parts
    if "\\" in name or "\0" in name or name.startswith("/") or ".." in parts or ":" in name:
        raise InvalidModel(f"unsafe member name {name[:200]!r} in the bundle (absolute, '..', or a drive)", path)
    return name


def read_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Every member of the bundle at ``path``, checked as the module docstring says.

    Raises:
        InvalidModel: not a zip, truncated, or a member whose headers disagree, overlap or leave the file.
        Unsupported: a compressed or encrypted member, zip64, a multi-disk archive.
    """
    path = str(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < _EOCD.size:
            raise InvalidModel(f"not a valid .task bundle: the file has only {size} bytes", path)
        cd_offset, cd_size, count, comment = _end_record(fd, size, path)
        if count > MAX_MEMBERS:
            raise InvalidModel(f"not a valid .task bundle: it claims {count} members", path)
        if cd_offset + cd_size > size or cd_size < count * _CENTRAL.size:
            raise InvalidModel(
                f"not a valid .task bundle: the central directory ({cd_size} bytes at offset {cd_offset}) "
                f"does not fit the file ({size} bytes)",
                path,
            )
        directory = _pread(fd, cd_size, cd_offset, "the central directory", path)
        members = [_member(fd, directory, pos, cd_offset, path) for pos in _entries(directory, count, path)]
    finally:
        os.close(fd)
    _check_layout(members, path)
    return Bundle(path, size, members, comment)


def _entries(directory: bytes, count: int, path: str) -> list[int]:
    """Where each of ``count`` central entries starts in ``directory``."""
    pos, starts = 0, []
    for i in range(count):
        if pos + _CENTRAL.size > len(directory):
            raise InvalidModel(f"not a valid .task bundle: central entry {i} runs past the directory", path)
        fields = _CENTRAL.unpack_from(directory, pos)
        if fields[0] != CENTRAL_SIG:
            raise InvalidModel(f"not a valid .task bundle: central entry {i} has no signature", path)
        starts.append(pos)
        pos += _CENTRAL.size + fields[10] + fields[11] + fields[12]  # name, extra, comment
    if pos > len(directory):
        raise InvalidModel("not a valid .task bundle: the last central entry runs past the directory", path)
    return starts


def _member(fd: int, directory: bytes, pos: int, cd_offset: int, path: str) -> Member:
    (_, made_by, _, flags, method, mtime, mdate, crc, csize, usize, nlen, xlen, _, disk, _, attr, offset) = (
        _CENTRAL.unpack_from(directory, pos)
    )
    start = pos + _CENTRAL.size
    if start + nlen > len(directory):
        raise InvalidModel("not a valid .task bundle: a member name runs past the central directory", path)
    name = _check_name(directory[start : start + nlen], flags, path)
    if flags & FLAG_ENCRYPTED:
        raise Unsupported(f"member {name!r} is encrypted; MediaPipe reads only stored, plain members", path)
    if method != STORED:
        raise Unsupported(
            f"member {name!r} is compressed (zip method {method}); MediaPipe reads only STORED members "
            "(re-zip the bundle without compression: zip -0)",
            path,
        )
    if csize != usize:
        raise InvalidModel(f"member {name!r} is stored but its sizes differ ({csize} vs {usize})", path)
    if 0xFFFFFFFF in (csize, offset) or disk:
        raise Unsupported(f"member {name!r} uses zip64 or another disk; not supported for .task bundles", path)
    if offset + _LOCAL.size > cd_offset:
        raise InvalidModel(f"member {name!r}: its local header lies past the central directory", path)
    local = _LOCAL.unpack_from(_pread(fd, _LOCAL.size, offset, f"the local header of {name!r}", path))
    sig, _, lflags, lmethod, _, _, lcrc, lcsize, lusize, lnlen, lxlen = local
    if sig != LOCAL_SIG:
        raise InvalidModel(f"member {name!r}: no local header at offset {offset}", path)
    raw = _pread(fd, lnlen, offset + _LOCAL.size, f"the local name of {name!r}", path)
    if raw != directory[start : start + nlen] or lmethod != method:
        raise InvalidModel(f"member {name!r}: its local header disagrees with the central directory", path)
    if not (lflags & FLAG_DESCRIPTOR and lcsize == lusize == 0) and (lcsize, lusize, lcrc) != (csize, usize, crc):
        raise InvalidModel(f"member {name!r}: local and central sizes or CRC disagree", path)
    data = offset + _LOCAL.size + lnlen + lxlen
    if data + csize > cd_offset:
        raise InvalidModel(
            f"member {name!r}: its {csize} bytes at offset {data} run into the central directory (at {cd_offset})", path
        )
    return Member(name, offset, data, csize, crc, flags, mtime, mdate, attr, made_by)


def _check_layout(members: list[Member], path: str) -> None:
    """No two members share a name or a byte: the members' sizes add up to at most the file."""
    names: set[str] = set()
    for m in members:
        if m.name in names:
            raise InvalidModel(f"member {m.name!r} appears twice in the bundle", path)
        names.add(m.name)
    end = 0
    for m in sorted(members, key=lambda m: m.header_offset):
        if m.header_offset < end:
            raise InvalidModel(f"member {m.name!r} overlaps the member before it", path)
        end = m.data_offset + m.size


def member_crc(fd: int, member: Member) -> int:
    """CRC-32 of the member's bytes, read in chunks."""
    crc, done = 0, 0
    while done < member.size:
        chunk = os.pread(fd, min(CHUNK, member.size - done), member.data_offset + done)
        if not chunk:
            raise InvalidModel(f"member {member.name!r}: the file ended early")
        crc, done = zlib.crc32(chunk, crc), done + len(chunk)
    return crc


def _extra_for(pos: int, name_len: int, align: int) -> bytes:
    """The zipalign extra field that puts a member's data (after a local header at ``pos``) on ``align``."""
    data = pos + _LOCAL.size + name_len
    pad = (-data) % align
    if pad == 0:
        return b""
    while pad < 6:  # the record itself: id, length, alignment
        pad += align
    return struct.pack("<HHH", ZIPALIGN_EXTRA, pad - 4, min(align, 0xFFFF)) + b"\0" * (pad - 6)


def aligned_offsets(bundle: Bundle, align: int) -> list[int]:
    """Where ``write_bundle`` puts each member's data (planned before a byte is written)."""
    pos, out = 0, []
    for m in bundle.members:
        name = m.name.encode("utf-8")
        data = pos + _LOCAL.size + len(name) + len(_extra_for(pos, len(name), align))
        out.append(data)
        pos = data + m.size
    return out


def _local_header(m: Member, name: bytes, flags: int, extra: bytes) -> bytes:
    fields = (LOCAL_SIG, 20, flags, STORED, m.mod_time, m.mod_date, m.crc32, m.size, m.size, len(name), len(extra))
    return _LOCAL.pack(*fields) + name + extra


def _central_entry(m: Member, name: bytes, flags: int, pos: int) -> bytes:
    fields = (CENTRAL_SIG, m.version_made_by, 20, flags, STORED, m.mod_time, m.mod_date, m.crc32, m.size, m.size)
    return _CENTRAL.pack(*fields, len(name), 0, 0, 0, 0, m.external_attr, pos) + name


def _copy_member(src: int, f: BinaryIO, m: Member, path: str) -> None:
    """Stream the member's bytes, checked against its CRC-32 on the way."""
    crc, done = 0, 0
    while done < m.size:
        chunk = os.pread(src, min(CHUNK, m.size - done), m.data_offset + done)
        if not chunk:
            raise InvalidModel(f"member {m.name!r}: the file ended early", path)
        crc, done = zlib.crc32(chunk, crc), done + len(chunk)
        f.write(chunk)
    if crc != m.crc32:
        raise InvalidModel(f"member {m.name!r}: its bytes fail their CRC-32 (damaged bundle)", path)


def write_bundle(bundle: Bundle, out: Path, align: int) -> None:
    """Write ``bundle``'s members, same names and order, each member's data at a multiple of ``align``."""
    ends = [o + m.size for o, m in zip(aligned_offsets(bundle, align), bundle.members, strict=True)]
    if ends and ends[-1] >= 0xFFFFFFFF:
        raise Unsupported("the aligned bundle would pass 4 GiB (zip64 is not written)", bundle.path)
    cd = []
    src = os.open(bundle.path, os.O_RDONLY)
    try:
        with open(out, "wb") as f:
            for m in bundle.members:
                name = m.name.encode("utf-8")
                pos = f.tell()
                flags = (m.flags & ~FLAG_DESCRIPTOR) | FLAG_UTF8  # sizes and CRC are in the local header
                f.write(_local_header(m, name, flags, _extra_for(pos, len(name), align)))
                _copy_member(src, f, m, bundle.path)
                cd.append(_central_entry(m, name, flags, pos))
            start = f.tell()
            directory = b"".join(cd)
            f.write(directory)
            end = _EOCD.pack(EOCD_SIG, 0, 0, len(cd), len(cd), len(directory), start, len(bundle.comment))
            f.write(end + bundle.comment)
    except OSError as e:
        raise OutputError(f"cannot write the bundle: {e.strerror or e}", out) from None
    finally:
        os.close(src)
