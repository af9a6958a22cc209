// Redis tier against real redis-server processes on loopback ports chosen here: entries with
// TTL, pipelined writes, two processes sharing through Redis, a corrupted or misplaced blob
// refused and counted, Redis killed or stopped mid-run (misses within the timeout, backoff,
// reconnect), and a 3-node Redis Cluster (CRC16 slots, CLUSTER SLOTS, MOVED, ASK).
// Without hiredis or redis-server every case reports a skip and passes.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/tier/redis_tier.hpp>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tier_test_util.hpp"
#include "tier_redis_util.hpp"

using namespace kvcache;

#if KVCACHE_HAS_REDIS_TIER
namespace {
using redis_chain = tier::tier_cache<tiertest::tier_kv, tier::redis_tier>;

bool redis_can_run() {
    if (tiertest::redis_on_path("redis-server") && tiertest::redis_on_path("redis-cli")) return true;
    MESSAGE("SKIPPED: redis-server / redis-cli not on PATH (Debian: apt-get install redis-server)");
    return false;
}
tier::redis_tier_options redis_opts(int port) {
    tier::redis_tier_options o;
    o.nodes = {tier::redis_endpoint{"127.0.0.1", port}};
    o.prefix = "kvt:";
    o.connect_timeout_ms = 200;
    o.io_timeout_ms = 300;
    o.backoff_min_ms = 200;
    return o;
}
std::vector<std::byte> redis_expected(seq_id_t dst, std::uint32_t n, std::uint32_t seed, std::uint32_t fill) {
    tiertest::tier_kv ref(tiertest::tier_shape());
    tiertest::tier_fill(ref, dst, fill, seed);
    REQUIRE(ref.seq_rm(dst, static_cast<pos_t>(n), -1));
    return tiertest::tier_seq_bytes(ref, dst);
}
double redis_ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace
#endif

TEST_SUITE("tier_redis") {
TEST_CASE("redis tier: put/get with TTL, pipelined writes, two processes sharing, refusals counted") {
#if !KVCACHE_HAS_REDIS_TIER
    MESSAGE("SKIPPED: built without hiredis (Debian: apt-get install libhiredis-dev)");
#else
    if (!redis_can_run()) return;
    const std::string scratch = tiertest::tier_scratch_dir("redis");
    tiertest::redis_server srv;
    REQUIRE(tiertest::redis_start_any(srv, scratch, false));
    tiertest::redis_raw raw(srv.port);

    // Pipelined puts: nothing is sent before the queue fills or a read comes.
    {
        auto o = redis_opts(srv.port);
        o.pipeline = 4;
        o.ttl_ms = 60000;
        tier::redis_tier t(o);
        std::vector<std::byte> b(1000, std::byte{3});
        for (int i = 0; i < 3; ++i) {
            tier::key k;
            k.digest[0] = static_cast<std::uint8_t>(i);
            REQUIRE(t.put(k, b));
        }
        CHECK(raw.cmd({"DBSIZE"}) == "0");  // queued
        tier::key k0;
        std::vector<std::byte> out;
        CHECK(t.get(k0, out));  // sends the queue first
        CHECK(out == b);
        CHECK(raw.cmd({"DBSIZE"}) == "3");
        const long long pttl = std::stoll(raw.cmd({"PTTL", "kvt:" + k0.hex()}));
        CHECK(pttl > 50000);
        CHECK(pttl <= 60000);
        CHECK(t.contains(k0));
        CHECK(t.erase(k0));
        CHECK_FALSE(t.contains(k0));
        CHECK_FALSE(t.get(k0, out));
        // A short TTL expires.
        auto o2 = redis_opts(srv.port);
        o2.ttl_ms = 100;
        o2.pipeline = 1;
        tier::redis_tier t2(o2);
        tier::key k9;
        k9.digest[5] = 9;
        REQUIRE(t2.put(k9, b));
        CHECK(t2.contains(k9));
        std::this_thread::sleep_for(std::chrono::milliseconds(250));
        CHECK_FALSE(t2.get(k9, out));
    }

    // Process A publishes; process B (fresh) hits.
    const prompt_tokens p = tiertest::tier_prompt(80, 31);
    const pid_t a = ::fork();
    if (a == 0) {
        int rc = 1;
        try {
            tiertest::tier_kv c(tiertest::tier_shape());
            tiertest::tier_fill(c, 0, 80, 31);
            redis_chain tc({.block_tokens = 32}, tier::redis_tier(redis_opts(srv.port)));
            rc = tc.publish(c, 0, p).stored ? 0 : 2;
            tc.get<0>().sync();
            if (tc.get<0>().stats().put_failures != 0) rc = 3;
        } catch (...) {
            rc = 99;
        }
        ::_exit(rc);
    }
    int st = 0;
    ::waitpid(a, &st, 0);
    REQUIRE(WIFEXITED(st));
    REQUIRE(WEXITSTATUS(st) == 0);
    tiertest::tier_kv c(tiertest::tier_shape());
    redis_chain tc({.block_tokens = 32}, tier::redis_tier(redis_opts(srv.port)));
    auto f = tc.fetch(c, 1, p);
    CHECK(f.n_tokens == 80);
    CHECK(tiertest::tier_seq_bytes(c, 1) == redis_expected(1, 80, 31, 80));
    REQUIRE(c.seq_rm(1, -1, -1));

    // The blob corrupted inside Redis: checksum refusal, counted, deleted.
    const auto fp = tier::memory_fingerprint(c);
    const auto k64 = tier::block_keys(p, 32, fp, 0).back().k;
    const std::string rk = "kvt:" + k64.hex();
    const std::string good = raw.cmd({"GET", rk});
    REQUIRE(good.size() > 1000);
    CHECK(raw.cmd({"SETRANGE", rk, "900", "X"}) == std::to_string(good.size()));
    CHECK(tc.fetch(c, 1, p).n_tokens == 0);
    CHECK(tc.metrics().tiers[0].refused_for(tier::refusal::corrupt) == 1);
    CHECK(raw.cmd({"EXISTS", rk}) == "0");
    CHECK(c.seq_pos_max(1) < 0);
    // Another tenant's blob placed under this key: refused (key), counted.
    tiertest::tier_kv c2(tiertest::tier_shape());
    tiertest::tier_fill(c2, 0, 80, 31);
    REQUIRE(tc.publish(c2, 0, p, 77).stored);
    tc.get<0>().sync();
    const std::string other = raw.cmd({"GET", "kvt:" + tier::block_keys(p, 32, fp, 77).back().k.hex()});
    REQUIRE(!other.empty());
    CHECK(raw.cmd({"SET", rk, other}) == "OK");
    CHECK(tc.fetch(c, 1, p).n_tokens == 0);
    CHECK(tc.metrics().tiers[0].refused_for(tier::refusal::key) == 1);
    // Another model (3 layers) never finds this model's entries.
    tiertest::tier_kv c3(tiertest::tier_shape(3));
    redis_chain tc3({.block_tokens = 32}, tier::redis_tier(redis_opts(srv.port)));
    CHECK(tc3.fetch(c3, 0, p, 77).n_tokens == 0);
    CHECK(tc.fetch(c, 1, p, 77).n_tokens == 80);  // its own tenant: served
    srv.stop();
    tiertest::tier_remove_dir(scratch);
#endif
}

TEST_CASE("redis tier: server stopped or killed mid-run: misses within the timeout, backoff, reconnect") {
#if !KVCACHE_HAS_REDIS_TIER
    MESSAGE("SKIPPED: built without hiredis");
#else
    if (!redis_can_run()) return;
    const std::string scratch = tiertest::tier_scratch_dir("redisdown");
    tiertest::redis_server srv;
    REQUIRE(tiertest::redis_start_any(srv, scratch, false, 1));
    const prompt_tokens p = tiertest::tier_prompt(64, 8);
    tiertest::tier_kv c(tiertest::tier_shape());
    tiertest::tier_fill(c, 0, 64, 8);
    redis_chain tc({.block_tokens = 32}, tier::redis_tier(redis_opts(srv.port)));
    REQUIRE(tc.publish(c, 0, p).stored);
    CHECK(tc.fetch(c, 1, p).n_tokens == 64);
    REQUIRE(c.seq_rm(1, -1, -1));

    // Slow: the server stops answering (SIGSTOP). The fetch misses after about one io timeout.
    ::kill(srv.pid, SIGSTOP);
    auto t0 = std::chrono::steady_clock::now();
    CHECK(tc.fetch(c, 1, p).n_tokens == 0);
    double ms = redis_ms_since(t0);
    CHECK(ms < 1500);  // one 300 ms timeout, then the node backs off: the shorter key is not tried
    CHECK(tc.get<0>().stats().errors >= 1);
    t0 = std::chrono::steady_clock::now();
    CHECK(tc.fetch(c, 1, p).n_tokens == 0);  // backing off: answered at once
    CHECK(redis_ms_since(t0) < 50);
    CHECK(tc.get<0>().stats().skipped_down >= 1);
    CHECK_FALSE(tc.publish(c, 0, tiertest::tier_prompt(64, 9)).stored);  // not tried, counted
    ::kill(srv.pid, SIGCONT);
    std::this_thread::sleep_for(std::chrono::milliseconds(450));  // past the backoff
    CHECK(tc.fetch(c, 1, p).n_tokens == 64);  // reconnected
    REQUIRE(c.seq_rm(1, -1, -1));

    // Killed: misses at once (connection refused), then a new server on the same port
    // (empty) is used again after the backoff.
    const int port = srv.port;
    srv.stop();
    t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 5; ++i) CHECK(tc.fetch(c, 1, p).n_tokens == 0);
    CHECK(redis_ms_since(t0) < 1500);
    CHECK(c.seq_pos_max(1) < 0);
    tiertest::redis_server again;
    REQUIRE(again.start(port, scratch, false));
    std::this_thread::sleep_for(std::chrono::milliseconds(1700));  // the backoff doubled a few times
    CHECK(tc.fetch(c, 1, p).n_tokens == 0);  // the new server is empty: a plain miss
    REQUIRE(tc.publish(c, 0, p).stored);
    CHECK(tc.fetch(c, 1, p).n_tokens == 64);
    CHECK(tiertest::tier_seq_bytes(c, 1) == redis_expected(1, 64, 8, 64));
    CHECK_THROWS_AS(tier::redis_tier(tier::redis_tier_options{.nodes = {}}), kvcache::error);
    again.stop();
    tiertest::tier_remove_dir(scratch);
#endif
}
}

TEST_SUITE("tier_redis_cluster") {
TEST_CASE("redis tier: a blob longer than chunk_bytes is stored as chunks and a manifest") {
#if !KVCACHE_HAS_REDIS_TIER
    MESSAGE("SKIPPED: built without hiredis");
#else
    if (!redis_can_run()) return;
    const std::string scratch = tiertest::tier_scratch_dir("redis_chunks");
    tiertest::redis_server srv;
    REQUIRE(tiertest::redis_start_any(srv, scratch, false));
    tiertest::redis_raw raw(srv.port);
    auto o = redis_opts(srv.port);
    o.chunk_bytes = 256;
    tier::redis_tier t(o);
    std::vector<std::byte> blob(1000);
    for (std::size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<std::byte>(i * 37 + 5);
    tier::key k;
    k.digest[3] = 42;
    const std::string rk = "kvt:" + k.hex();
    REQUIRE(t.put(k, blob));
    t.sync();
    CHECK(raw.cmd({"DBSIZE"}) == "5");  // 4 chunks (256, 256, 256, 232) + the manifest
    CHECK(raw.cmd({"STRLEN", rk}) == "24");
    CHECK(raw.cmd({"STRLEN", rk + "#3"}) == "232");
    CHECK(raw.cmd({"GETRANGE", rk, "0", "3"}) == "KVRC");
    CHECK(std::stoll(raw.cmd({"PTTL", rk + "#0"})) > 0);  // every chunk has the TTL
    std::vector<std::byte> out;
    CHECK(t.get(k, out));
    CHECK(out == blob);

    // A chunk of the wrong length, or a missing one, is a miss (never a short blob).
    CHECK(raw.cmd({"SET", rk + "#2", "short"}) == "OK");
    CHECK_FALSE(t.get(k, out));
    CHECK(raw.cmd({"DEL", rk + "#2"}) == "1");
    CHECK_FALSE(t.get(k, out));

    // A blob of exactly chunk_bytes stays one value; erase removes a chunked entry's chunks.
    tier::key k2;
    k2.digest[3] = 43;
    const std::vector<std::byte> one(256, std::byte{7});
    REQUIRE(t.put(k2, one));
    REQUIRE(t.put(k, blob));
    t.sync();
    CHECK(raw.cmd({"STRLEN", "kvt:" + k2.hex()}) == "256");
    CHECK(t.get(k2, out));
    CHECK(out == one);
    CHECK(raw.cmd({"DBSIZE"}) == "6");
    CHECK(t.erase(k));
    CHECK(raw.cmd({"DBSIZE"}) == "1");
    CHECK_FALSE(t.contains(k));
    CHECK(t.contains(k2));
    srv.stop();
    tiertest::tier_remove_dir(scratch);
#endif
}

TEST_CASE("redis cluster: CRC16 key slots (spec vectors, and the server's CLUSTER KEYSLOT)") {
#if !KVCACHE_HAS_REDIS_TIER
    MESSAGE("SKIPPED: built without hiredis");
#else
    static_assert(tier::crc16_xmodem("123456789") == 0x31C3);  // the cluster spec's check value
    CHECK(tier::redis_slot("foo") == 12182);
    CHECK(tier::redis_slot("{user1000}.following") == tier::redis_slot("{user1000}.followers"));
    CHECK(tier::redis_slot("foo{}{bar}") == (tier::crc16_xmodem("foo{}{bar}") & 16383));
    CHECK(tier::redis_slot("foo{{bar}}zap") == (tier::crc16_xmodem("{bar") & 16383));
    CHECK(tier::redis_slot("foo{bar}{zap}") == (tier::crc16_xmodem("bar") & 16383));
#endif
}

TEST_CASE("redis cluster: 3 nodes, slot map, MOVED and ASK redirects") {
#if !KVCACHE_HAS_REDIS_TIER
    MESSAGE("SKIPPED: built without hiredis");
#else
    if (!redis_can_run()) return;
    const std::string scratch = tiertest::tier_scratch_dir("cluster");
    tiertest::redis_server n[3];
    for (int i = 0; i < 3; ++i) REQUIRE(tiertest::redis_start_any(n[i], scratch, true, 10 + i));
    {
        tiertest::redis_raw r0(n[0].port);
        for (const char* k : {"a", "kvt:0123", "{x}y", "foo{}{bar}"})
            CHECK(r0.cmd({"CLUSTER", "KEYSLOT", k}) == std::to_string(tier::redis_slot(k)));
    }
    std::string create = "redis-cli --cluster create";
    for (auto& s : n) create += " 127.0.0.1:" + std::to_string(s.port);
    create += " --cluster-replicas 0 --cluster-yes > " + scratch + "/create.log 2>&1";
    REQUIRE(std::system(create.c_str()) == 0);
    bool ready = false;
    for (int i = 0; i < 100 && !ready; ++i) {
        ready = true;
        for (auto& s : n) {
            tiertest::redis_raw r(s.port);
            ready = ready && r.cmd({"CLUSTER", "INFO"}).find("cluster_state:ok") != std::string::npos;
        }
        if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    REQUIRE(ready);

    auto key_of = [](int i) {
        tier::key k;
        k.digest[0] = static_cast<std::uint8_t>(i);
        k.digest[1] = static_cast<std::uint8_t>(i * 7);
        return k;
    };
    const std::vector<std::byte> blob(500, std::byte{9});
    std::vector<std::byte> out;
    {  // Slot map read at the first call: every key to its owner, no redirect.
        auto o = redis_opts(n[0].port);
        o.cluster = true;
        tier::redis_tier t(o);
        for (int i = 0; i < 60; ++i) REQUIRE(t.put(key_of(i), blob));
        t.sync();
        for (int i = 0; i < 60; ++i) CHECK(t.get(key_of(i), out));
        CHECK(t.stats().moved == 0);
        CHECK(t.stats().put_failures == 0);
        CHECK(t.stats().slot_refreshes >= 1);
        for (auto& s : n) {
            tiertest::redis_raw r(s.port);
            CHECK(std::stoi(r.cmd({"DBSIZE"})) > 5);  // spread over the three nodes
        }
        // A chunked blob: each chunk goes to the node of its own key's slot.
        auto oc = o;
        oc.chunk_bytes = 64;
        tier::redis_tier tc(oc);
        std::vector<std::byte> big(2000);
        for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<std::byte>(i * 11 + 1);
        REQUIRE(tc.put(key_of(100), big));
        CHECK(tc.get(key_of(100), out));
        CHECK(out == big);
        CHECK(tc.stats().put_failures == 0);
        CHECK(tc.erase(key_of(100)));
        CHECK_FALSE(tc.get(key_of(100), out));
    }
    {  // No slot map: every key is sent to the seed; the others answer MOVED, followed.
        auto o = redis_opts(n[1].port);
        o.cluster = true;
        o.load_slots = false;
        tier::redis_tier t(o);
        for (int i = 0; i < 60; ++i) CHECK(t.get(key_of(i), out));
        CHECK(t.stats().moved > 0);
        CHECK(t.stats().moved < 60);  // learnt slot by slot
        for (int i = 60; i < 80; ++i) REQUIRE(t.put(key_of(i), blob));
        t.sync();
        CHECK(t.stats().put_failures == 0);
        for (int i = 60; i < 80; ++i) CHECK(t.get(key_of(i), out));
    }
    {  // A slot being migrated: the source answers ASK for a key it lacks.
        auto o = redis_opts(n[0].port);
        o.cluster = true;
        o.pipeline = 1;
        tier::redis_tier t(o);
        const tier::key k = key_of(200);
        const std::string rk = "kvt:" + k.hex();
        const std::string slot = std::to_string(tier::redis_slot(rk));
        int src = -1;
        for (int i = 0; i < 3; ++i) {
            tiertest::redis_raw r(n[i].port);
            if (r.cmd({"CLUSTER", "COUNTKEYSINSLOT", slot}) == "0" && r.cmd({"GET", rk}).find("MOVED") == std::string::npos)
                src = i;
        }
        REQUIRE(src >= 0);
        const int dst = (src + 1) % 3;
        tiertest::redis_raw rs(n[src].port), rd(n[dst].port);
        const std::string src_id = rs.cmd({"CLUSTER", "MYID"}), dst_id = rd.cmd({"CLUSTER", "MYID"});
        CHECK(rd.cmd({"CLUSTER", "SETSLOT", slot, "IMPORTING", src_id}) == "OK");
        CHECK(rs.cmd({"CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id}) == "OK");
        REQUIRE(t.put(k, blob));
        CHECK(t.get(k, out));
        CHECK(out == blob);
        CHECK(t.stats().ask >= 2);
        CHECK(rd.cmd({"CLUSTER", "COUNTKEYSINSLOT", slot}) == "1");
    }
    for (auto& s : n) s.stop();
    tiertest::tier_remove_dir(scratch);
#endif
}
}
