"""A network namespace joined to this machine by a veth pair, for the tests that cut a replica off.

``Namespace.create`` makes a namespace (``ip netns add``) and a veth pair with an address on each
end, in a /30 of 10.213.0.0/16 picked at random: the host end's ``host_ip`` is where a server in
the root namespace can listen for the namespace's processes; ``command`` runs a program inside.
``cut`` takes the host end down, so what the namespace sends is dropped without an answer (a
partition: connections hang, they do not fail); ``heal`` brings it back. ``remove`` deletes the
namespace, and the pair with it. Needs root and iproute2 (Debian's ``iproute2``).
"""

from __future__ import annotations

import contextlib
import random
import secrets
import subprocess

import attrs


def _ip(*arguments: str) -> None:
    done = subprocess.run(["ip", *arguments], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(arguments)} failed: {done.stderr.strip()}")


@attrs.define
class Namespace:
    """One namespace ``name``, reached from the host at ``guest_ip``, reaching it at ``host_ip``."""

    name: str
    host_link: str
    host_ip: str
    guest_ip: str

    @classmethod
    def create(cls) -> Namespace:
        token = secrets.token_hex(3)
        third, fourth = random.randrange(256), random.randrange(0, 256, 4)
        namespace = cls(
            f"bg-{token}", f"bgh{token}", f"10.213.{third}.{fourth + 1}", f"10.213.{third}.{fourth + 2}"
        )
        guest_link = f"bgg{token}"
        _ip("netns", "add", namespace.name)
        try:
            _ip("link", "add", namespace.host_link, "type", "veth", "peer", "name", guest_link)
            _ip("link", "set", guest_link, "netns", namespace.name)
            _ip("addr", "add", f"{namespace.host_ip}/30", "dev", namespace.host_link)
            _ip("link", "set", namespace.host_link, "up")
            inside = ("netns", "exec", namespace.name, "ip")
            _ip(*inside, "addr", "add", f"{namespace.guest_ip}/30", "dev", guest_link)
            _ip(*inside, "link", "set", guest_link, "up")
            _ip(*inside, "link", "set", "lo", "up")
        except BaseException:
            namespace.remove()
            raise
        return namespace

    def command(self, *program: str) -> list[str]:
        """``program`` as a command line that runs it inside the namespace."""
        return ["ip", "netns", "exec", self.name, *program]

    def cut(self) -> None:
        _ip("link", "set", self.host_link, "down")

    def heal(self) -> None:
        _ip("link", "set", self.host_link, "up")

    def remove(self) -> None:
        with contextlib.suppress(RuntimeError):
            _ip("link", "del", self.host_link)
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", self.name)
