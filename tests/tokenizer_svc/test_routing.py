"""Prefix-aware decode routing: target resolution, the hash ring, the first-page key and the load
bound (the end-to-end effect on prefix-cache hits is bench prefix-routing's)."""
from __future__ import annotations

import asyncio
import collections

from concurrent import futures

import grpc
import pytest

from kvwire_serving.security import ClientSecurity
from tokenizer_svc.routing import (HashRing, PrefixRouter, RoutingConfig, first_page_key, replica_security,
                                   resolve)
from tools.stack import free_port

ADDRS = [f"127.0.0.1:{p}" for p in (50101, 50102, 50103)]  # never dialled: the ring only hashes names


@pytest.fixture(scope="module")
def live():
    """Three listening gRPC servers. A router skips a replica whose channel is in TRANSIENT_FAILURE,
    and a channel to a port nobody listens on gets there in the background, mid-test; so the tests
    of the load bound route over replicas that are up."""
    servers, addrs = [], []
    for _ in range(3):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        addrs.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    yield addrs
    for server in servers:
        server.stop(0)


def test_resolve_lists_names_and_plain_addresses():
    assert resolve("ipv4:127.0.0.1:1,127.0.0.1:2") == ["127.0.0.1:1", "127.0.0.1:2"]
    assert resolve("decode:50052") == ["decode:50052"]
    assert resolve("dns:///localhost:7") in (["127.0.0.1:7"], ["127.0.0.1:7", "[::1]:7"], ["[::1]:7"])


def test_a_replica_behind_a_dns_name_is_verified_as_that_name():
    tls = ClientSecurity(ca_file="ca.pem")
    assert replica_security("dns:///decode.ns.svc:50052", tls).server_name == "decode.ns.svc"
    assert replica_security("dns:///decode:50052", ClientSecurity(ca_file="ca.pem", server_name="x")).server_name == "x"
    assert replica_security("ipv4:127.0.0.1:1,127.0.0.1:2", tls) is tls
    assert replica_security("dns:///decode:50052", ClientSecurity()).server_name is None  # plaintext


def test_first_page_key_depends_on_the_first_page_only():
    block = 16
    shared = list(range(100, 116))
    assert first_page_key(shared + [1, 2, 3], block) == first_page_key(shared + [9] * 40, block)
    assert first_page_key(shared, block) != first_page_key([7] + shared[1:], block)
    assert first_page_key(shared[:15], block) is None  # no full page: no key


def test_ring_spreads_keys_and_removing_a_replica_moves_only_its_keys():
    ring, smaller = HashRing(ADDRS), HashRing(ADDRS[:2])
    keys = [first_page_key(list(range(i, i + 16)), 16) for i in range(3000)]
    owners = [ring.walk(k)[0] for k in keys]
    counts = collections.Counter(owners)
    assert set(counts) == set(ADDRS) and min(counts.values()) > 600  # even within ~40%
    for key, owner in zip(keys, owners):
        assert sorted(ring.walk(key)) == sorted(ADDRS)
        if owner != ADDRS[2]:
            assert smaller.walk(key)[0] == owner  # the keys of the removed replica alone move


def router_over(addrs: list[str], load_factor: float = 1.25) -> PrefixRouter:
    return PrefixRouter("ipv4:" + ",".join(addrs), grpc.aio.insecure_channel, RoutingConfig("prefix", load_factor))


def test_same_first_page_same_replica_until_the_load_bound(live):
    async def main():
        router = router_over(live)
        prompt = list(range(200, 232))
        leases = [router.lease(prompt + [i]) for i in range(5)]
        owner = leases[0].addr
        # bound = max(min_bound 4, ceil(1.25 * (open + 1) / 3)): four at once on the owner, the fifth is over
        assert [lease.addr for lease in leases[:4]] == [owner] * 4
        assert leases[4].addr == router.ring.walk(first_page_key(prompt, 16))[1] != owner
        for lease in leases:
            lease.release()
        assert sum(router.inflight.values()) == 0
        assert router.lease(prompt).addr == owner  # back to the owner once it is under the bound
        await router.close()
    asyncio.run(main())


def test_a_replica_that_is_down_is_skipped():
    async def main():
        down, up = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        server = grpc.aio.server()
        server.add_insecure_port(up)
        await server.start()
        router = router_over([down, up], load_factor=100)
        for addr in (down, up):  # connect both and wait until the dead one is known to be down
            router.channels[addr].get_state(try_to_connect=True)
        for _ in range(100):
            if router.channels[down].get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                break
            await asyncio.sleep(0.05)
        prompts = [list(range(i, i + 16)) for i in range(40)]
        assert {router.ring.walk(first_page_key(p, 16))[0] for p in prompts} == {down, up}
        assert {router.lease(p).addr for p in prompts} == {up}
        await router.close()
        await server.stop(0)
    asyncio.run(main())


def test_short_prompts_go_to_the_least_loaded_replica(live):
    async def main():
        router = router_over(live[:2])
        a, b = router.lease([1, 2, 3]), router.lease([1, 2, 3])
        assert {a.addr, b.addr} == set(live[:2])
        await router.close()
    asyncio.run(main())


@pytest.mark.parametrize("factor", [1.0, 1.5])
def test_the_load_bound_holds_for_one_hot_prefix(factor, live):
    async def main():
        router = router_over(live, load_factor=factor)
        leases = [router.lease(list(range(300, 316)) + [i]) for i in range(30)]
        loads = collections.Counter(lease.addr for lease in leases)
        assert max(loads.values()) <= max(4, -(-factor * 30 // 3))
        assert len(loads) > 1
        await router.close()
    asyncio.run(main())
