"""The listening sockets of a process tree, read from /proc (Linux): which addresses a server and
everything it started (Ray's processes, the workers, extra API processes) listen on."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

_LISTEN = {"tcp": "0A", "tcp6": "0A", "udp": "07", "udp6": "07"}
"""/proc/net/* state of a listening TCP socket / a bound, unconnected UDP socket."""


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str
    protocol: str
    """tcp, tcp6, udp or udp6."""
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback


def process_tree(root: int) -> list[int]:
    """`root`, its descendants and every process of its session (a daemon that left its parent)."""
    children: dict[int, list[int]] = {}
    session: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid, sid = int(entry), int(fields[1]), int(fields[3])
        children.setdefault(ppid, []).append(pid)
        if sid == root:
            session.append(pid)
    found, todo = set(), [root, *session]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return sorted(found)


def listeners(root: int) -> list[Listener]:
    """Every listening TCP and bound UDP socket held by a process of `root`'s tree."""
    bound = _bound_sockets()
    out = []
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        for inode in _socket_inodes(pid):
            if inode in bound:
                out.append(Listener(pid, command, *bound.pop(inode)))  # a socket shared by a fork once
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _bound_sockets() -> dict[int, tuple[str, str, int]]:
    """inode -> (protocol, address, port) of every listening socket of the machine's namespace."""
    out = {}
    for protocol, state in _LISTEN.items():
        try:
            with open(f"/proc/net/{protocol}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != state:
                continue
            address, port = fields[1].split(":")
            out[int(fields[9])] = (protocol, _address(address), int(port, 16))
    return out


def _address(hex_address: str) -> str:
    """/proc/net's address: 32-bit words, each in the host's (little-endian) byte order."""
    raw = bytes.fromhex(hex_address)
    network = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, network)
