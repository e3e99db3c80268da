"""Hostfiles, the seed's rank tables, and which node each global rank runs on.

A DeepSpeed hostfile (MPI style) lists one node per line, `HOST slots=N`; `#` comments and blank lines are ignored.
DeepSpeed's launcher numbers ranks node after node in file order (node 0 gets ranks 0..N0-1, node 1 the next N1, …),
and `rank_nodes` reproduces that numbering, so `plan.py --hostfile H` shows exactly where each rank will run.

The MindSpore seed describes the same cluster with a rank table (`rank_table_16pcs.json`):

    {"version": "1.0", "server_count": "2",
     "server_list": [{"server_id": "192.0.2.10",
                      "device": [{"device_id": "0", "device_ip": "198.51.100.1", "rank_id": "0"}, …],
                      "host_nic_ip": "reserve"}, …],
     "status": "completed"}

`rank_table_to_hosts` turns it into hostfile entries (server_id → host, number of devices → slots), after checking
that its rank_ids are 0..N-1 and run server after server in server_list order, since that is the only numbering a
hostfile can express. No torch import here: the converter and the launch scripts stay fast.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import UserError

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)(\s.*)?$")  # DeepSpeed's pattern (extra MPI keys allowed)
# what a host name may hold: it travels unquoted through pdsh, ssh and the remote shell (and into MASTER_ADDR)
_HOST_NAME = re.compile(r"^[A-Za-z0-9_.:@\[\]-]+$")
BOM = "\ufeff"


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def _invisible(text: str) -> str:
    """The characters of `text` a terminal does not show (or shows as something else), named."""
    odd = sorted({c for c in text if not c.isprintable() or c in (BOM, "\u00a0", "\u200b")})
    return ", ".join(f"U+{ord(c):04X}" for c in odd)


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[Host]:
    """Hosts of a DeepSpeed hostfile, in order. Tolerated as DeepSpeed and MPI tolerate them: a byte-order mark,
    CRLF line ends, tabs, blank lines, `#` comments (whole-line or after the entry). Refused with one line naming
    the line: anything else that DeepSpeed would reject or that would reach ssh garbled — a duplicate host, a
    host name with characters a remote shell would re-read or a terminal would not show."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.replace(BOM, "").split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise UserError(
                f"{source} line {lineno}: {line!r} is not 'HOST slots=N' (DeepSpeed hostfile format, "
                f"e.g. 'worker-0 slots=8')"
            )
        name, slots = m.group(1), int(m.group(2))
        if not _HOST_NAME.match(name):
            hidden = _invisible(name)
            what = (
                f"holds characters a terminal does not show ({hidden})"
                if hidden
                else "holds characters other than letters, digits and . _ - : @ [ ]"
            )
            raise UserError(f"{source} line {lineno}: host {name!r} {what}; write the plain host name or address")
        if slots < 1:
            raise UserError(f"{source} line {lineno}: {name} has slots={slots}; every host needs slots >= 1")
        if name in seen:
            raise UserError(
                f"{source} line {lineno}: host {name} is listed twice (first on line {seen[name]}); "
                f"list each node once, with all its slots (DeepSpeed refuses duplicate hosts)"
            )
        seen[name] = lineno
        hosts.append(Host(name, slots))
    if not hosts:
        raise UserError(f"{source} lists no hosts: write one 'HOST slots=N' line per node")
    return hosts


def read_hostfile(path: str) -> list[Host]:
    if os.path.isdir(path):
        raise UserError(f"hostfile {path} is a folder; give the file (one 'HOST slots=N' line per node)")
    if not os.path.isfile(path):
        raise UserError(
            f"hostfile {path} not found (one 'HOST slots=N' line per node, see run_scripts/hostfiles/hostfile_2nodes)"
        )
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Windows editors) is dropped
            text = f.read()
    except UnicodeDecodeError as exc:
        raise UserError(
            f"hostfile {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); it needs one "
            f"'HOST slots=N' line per node"
        ) from None
    return parse_hostfile_text(text, source=f"hostfile {path}")


def format_hostfile(hosts: Sequence[Host], header: str | None = None) -> str:
    lines = [f"# {line}" for line in header.splitlines()] if header else []
    lines += [f"{h.name} slots={h.slots}" for h in hosts]
    return "\n".join(lines) + "\n"


def rank_nodes(
    world_size: int, hosts: Sequence[Host] | None = None, ranks_per_node: int = 8
) -> list[tuple[int, str, int]]:
    """(node index, host name, local rank) of every global rank, numbered as DeepSpeed's launcher does.

    With `hosts` the world must use exactly their slots; without, nodes of `ranks_per_node` ranks are assumed
    (named node0, node1, …)."""
    if hosts is None:
        if ranks_per_node < 1:
            raise UserError(f"--gpus_per_node {ranks_per_node} must be >= 1")
        return [(r // ranks_per_node, f"node{r // ranks_per_node}", r % ranks_per_node) for r in range(world_size)]
    total = sum(h.slots for h in hosts)
    if total != world_size:
        raise UserError(
            f"the hostfile has {total} slots ({', '.join(f'{h.name}:{h.slots}' for h in hosts)}) but "
            f"the world size is {world_size}"
        )
    out = []
    for i, h in enumerate(hosts):
        out += [(i, h.name, local) for local in range(h.slots)]
    return out


def _field(obj, key: str, where: str, kind=str):
    if not isinstance(obj, dict) or key not in obj:
        raise UserError(f'{where}: missing "{key}"')
    value = obj[key]
    if kind is int:
        try:
            return int(str(value).strip())
        except ValueError:
            raise UserError(f'{where}: "{key}" is {value!r}, not an integer') from None
    if kind is list and not isinstance(value, list):
        raise UserError(f'{where}: "{key}" must be a list, got {type(value).__name__}')
    if kind is str and (not isinstance(value, str) or not value.strip()):
        raise UserError(f'{where}: "{key}" must be a non-empty string, got {value!r}')
    return value


def rank_table_to_hosts(table: dict, source: str = "rank table") -> list[Host]:
    """The seed's rank table → hostfile entries (server_id, number of devices), checked for consistency."""
    if not isinstance(table, dict):
        raise UserError(f'{source}: expected a JSON object with "server_list", got {type(table).__name__}')
    servers = _field(table, "server_list", source, list)
    if not servers:
        raise UserError(f'{source}: "server_list" is empty')
    if "server_count" in table:
        count = _field(table, "server_count", source, int)
        if count != len(servers):
            raise UserError(f"{source}: server_count is {count} but server_list has {len(servers)} servers")
    hosts, seen, next_rank = [], set(), 0
    for i, server in enumerate(servers):
        where = f"{source}: server_list[{i}]"
        name = _field(server, "server_id", where).strip()
        if name in seen:
            raise UserError(f"{where}: server_id {name} appears twice")
        seen.add(name)
        devices = _field(server, "device", where, list)
        if not devices:
            raise UserError(f'{where} ({name}): "device" is empty')
        device_ids = []
        for j, dev in enumerate(devices):
            dwhere = f"{where}.device[{j}]"
            device_ids.append(_field(dev, "device_id", dwhere, int))
            rank = _field(dev, "rank_id", dwhere, int)
            if rank != next_rank:
                raise UserError(
                    f"{dwhere} ({name}): rank_id {rank}, expected {next_rank}: rank_ids must count "
                    f"0, 1, 2, … server after server, which is how DeepSpeed numbers a hostfile's slots"
                )
            next_rank += 1
        if len(set(device_ids)) != len(device_ids):
            raise UserError(f"{where} ({name}): device_id repeated in {device_ids}")
        hosts.append(Host(name, len(devices)))
    return hosts


def read_rank_table(path: str) -> list[Host]:
    from common.user_files import read_json

    table = read_json(path, "rank table")
    return rank_table_to_hosts(table, source=f"rank table {path}")


def hosts_to_rank_table(hosts: Sequence[Host], device_ip_base: str = "198.51.100") -> dict:
    """A rank table in the seed's format for `hosts` (used for the examples and the converter's round trip)."""
    servers, rank = [], 0
    for i, h in enumerate(hosts):
        devices = []
        for d in range(h.slots):
            devices.append(
                {
                    "device_id": str(d),
                    "device_ip": f"{device_ip_base}.{(i * h.slots + d) % 254 + 1}",
                    "rank_id": str(rank),
                }
            )
            rank += 1
        servers.append({"server_id": h.name, "device": devices, "host_nic_ip": "reserve"})
    return {"version": "1.0", "server_count": str(len(hosts)), "server_list": servers, "status": "completed"}
