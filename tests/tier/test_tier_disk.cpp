// Disk tier: restart persistence across processes (fork), corrupt and half-written files
// skipped and removed (counted), the byte limit with LRU, several processes writing one
// directory at once.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/tier/disk_tier.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tier_test_util.hpp"

using namespace kvcache;

namespace {
using disk_chain = tier::tier_cache<tiertest::tier_kv, tier::disk_tier>;

/// Runs f in a child process; returns its exit status (f's return value), -1 if it died.
template <class F>
int disk_in_child(F f) {
    const pid_t pid = ::fork();
    if (pid == 0) {
        int rc = 1;
        try {
            rc = f();
        } catch (...) {
            rc = 99;
        }
        ::_exit(rc);
    }
    int st = 0;
    ::waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

tier::key disk_key(int i) {
    tier::key k;
    k.digest[0] = static_cast<std::uint8_t>(i);
    k.digest[31] = 0xab;
    return k;
}
}  // namespace

TEST_SUITE("tier_disk") {
TEST_CASE("disk tier: published in one process, hit by a fresh process (restart)") {
    const std::string dir = tiertest::tier_scratch_dir("restart");
    const prompt_tokens p = tiertest::tier_prompt(70, 11);  // keys at 32 and 64
    tiertest::tier_kv ref(tiertest::tier_shape());
    tiertest::tier_fill(ref, 2, 70, 11);  // the sequence the fetch loads into
    REQUIRE(ref.seq_rm(2, 64, -1));
    const auto expect = tiertest::tier_seq_bytes(ref, 2);

    // Process 1 computes the prompt and publishes it, then exits.
    CHECK(disk_in_child([&] {
              tiertest::tier_kv c(tiertest::tier_shape());
              tiertest::tier_fill(c, 1, 70, 11);
              disk_chain tc({.block_tokens = 32}, tier::disk_tier(dir));
              const auto info = tc.publish(c, 1, p);
              return info.stored && info.key_tokens == 64 ? 0 : 1;
          }) == 0);
    // Process 2 (fresh memory, fresh index) asks with a longer request sharing 66 tokens.
    prompt_tokens req = p;
    req.keep_first(66);
    for (int i = 0; i < 30; ++i) req.push_back(7);
    CHECK(disk_in_child([&] {
              tiertest::tier_kv c(tiertest::tier_shape());
              disk_chain tc({.block_tokens = 32}, tier::disk_tier(dir));
              const auto f = tc.fetch(c, 2, req);
              if (f.n_tokens != 66 || f.tier != 0) return 1;
              REQUIRE(c.seq_rm(2, 64, -1));
              return tiertest::tier_seq_bytes(c, 2) == expect ? 0 : 2;
          }) == 0);
    // Another model (3 layers) and another tenant miss, counting nothing as a hit.
    tiertest::tier_kv c3(tiertest::tier_shape(3));
    disk_chain tc3({.block_tokens = 32}, tier::disk_tier(dir));
    CHECK(tc3.fetch(c3, 0, req).n_tokens == 0);
    tiertest::tier_kv c(tiertest::tier_shape());
    CHECK(tc3.fetch(c, 0, req, 99).n_tokens == 0);
    CHECK(c.seq_pos_max(0) < 0);
    CHECK(tc3.metrics().fetch_hits == 0);
    tiertest::tier_remove_dir(dir);
}

TEST_CASE("disk tier: a blob renamed under another key, another model's or tenant's blob, bit rot: refused and counted") {
    const std::string dir = tiertest::tier_scratch_dir("refuse");
    const prompt_tokens p = tiertest::tier_prompt(64, 5);
    tiertest::tier_kv c(tiertest::tier_shape());
    tiertest::tier_fill(c, 0, 64, 5);
    disk_chain tc({.block_tokens = 32}, tier::disk_tier(dir));
    REQUIRE(tc.publish(c, 0, p).stored);
    REQUIRE(tc.publish(c, 0, p, 8).stored);  // tenant 8
    const auto fp = tier::memory_fingerprint(c);
    const auto k0 = tier::block_keys(p, 32, fp, 0).back().k;
    const auto k8 = tier::block_keys(p, 32, fp, 8).back().k;
    auto& disk = tc.get<0>();
    // Tenant 8's blob copied over tenant 0's name: refused as another key.
    std::filesystem::copy_file(disk.path_of(k8), disk.path_of(k0), std::filesystem::copy_options::overwrite_existing);
    CHECK(tc.fetch(c, 1, p).n_tokens == 0);
    CHECK(tc.metrics().tiers[0].refused_for(tier::refusal::key) == 1);
    CHECK_FALSE(disk.contains(k0));  // erased
    // Bit rot inside the K/V payload of tenant 8's blob: checksum refusal, erased.
    {
        std::fstream f(disk.path_of(k8), std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(-100, std::ios::end);
        f.put('\x5a');
    }
    CHECK(tc.fetch(c, 1, p, 8).n_tokens == 0);
    CHECK(tc.metrics().tiers[0].refused_for(tier::refusal::corrupt) == 1);
    CHECK_FALSE(disk.contains(k8));
    CHECK(c.seq_pos_max(1) < 0);
    // A good blob again: served.
    REQUIRE(tc.publish(c, 0, p).stored);
    CHECK(tc.fetch(c, 1, p).n_tokens == 64);
    const std::string text = tier::to_prometheus(tc.metrics());
    CHECK(text.find("kvcache_tier_refused_total{tier=\"disk\",reason=\"corrupt\"} 1\n") != std::string::npos);
    CHECK(text.find("kvcache_tier_refused_total{tier=\"disk\",reason=\"key\"} 1\n") != std::string::npos);
    CHECK(text.find("kvcache_tier_hits_total{tier=\"disk\"} 1\n") != std::string::npos);
    tiertest::tier_remove_dir(dir);
}

TEST_CASE("disk tier: half-written and foreign files are skipped and removed by the lazy scan") {
    const std::string dir = tiertest::tier_scratch_dir("scan");
    tiertest::tier_kv c(tiertest::tier_shape());
    tiertest::tier_fill(c, 0, 32, 1);
    const prompt_tokens p = tiertest::tier_prompt(32, 1);
    const auto fp = tier::memory_fingerprint(c);
    auto blob_of = [&](int i) { return tier::make_blob(disk_key(i), fp, 0, 32, p, io::save_seq(c, 0)); };
    const std::vector<std::byte> blob = blob_of(0);
    {
        tier::disk_tier d(dir);
        for (int i = 0; i < 5; ++i) REQUIRE(d.put(disk_key(i), blob_of(i)));
        // A whole blob under another key's name: removed by the scan (misplaced).
        REQUIRE(d.put(disk_key(5), blob_of(6)));
    }
    // A torn copy (truncated), garbage, a stale temporary file, a fresh one, an unrelated file.
    auto write = [&](const std::string& name, std::span<const std::byte> b) {
        std::ofstream f(dir + "/" + name, std::ios::binary);
        f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    };
    tier::disk_tier probe(dir);
    write(disk_key(1).hex() + ".kvtb", std::span<const std::byte>(blob).first(blob.size() / 2));
    write(disk_key(2).hex() + ".kvtb", std::vector<std::byte>(200, std::byte{7}));
    write(".tmp-1-1-" + disk_key(3).hex(), std::span<const std::byte>(blob).first(10));
    write(".tmp-2-1-" + disk_key(4).hex(), std::span<const std::byte>(blob).first(10));
    write("notes.txt", std::span<const std::byte>(blob).first(10));
    std::filesystem::last_write_time(dir + "/.tmp-1-1-" + disk_key(3).hex(),
                                     std::filesystem::file_time_type::clock::now() - std::chrono::hours(2));
    tier::disk_tier d(dir, {.scan_batch = 2});
    std::vector<std::byte> out;
    CHECK_FALSE(d.get(disk_key(9), out));  // lists the directory
    CHECK(d.stats().scanned == 0);
    CHECK_FALSE(d.get(disk_key(9), out));  // checks two headers
    CHECK(d.stats().scanned + d.stats().stale_tmp_removed <= 2);
    d.scan_all();
    CHECK(d.stats().corrupt_removed == 3);
    CHECK(d.stats().stale_tmp_removed == 1);
    CHECK(d.size() == 3);
    CHECK(d.bytes() == 3 * blob.size());
    CHECK_FALSE(std::filesystem::exists(dir + "/" + disk_key(1).hex() + ".kvtb"));
    CHECK(std::filesystem::exists(dir + "/.tmp-2-1-" + disk_key(4).hex()));  // may still be written
    CHECK(std::filesystem::exists(dir + "/notes.txt"));                      // not ours
    CHECK(d.get(disk_key(0), out));
    CHECK(out == blob);
    // get() itself refuses a file whose size disagrees with its header (torn after the scan).
    write(disk_key(0).hex() + ".kvtb", std::span<const std::byte>(blob).first(blob.size() - 1));
    CHECK_FALSE(d.get(disk_key(0), out));
    CHECK(d.stats().corrupt_removed == 4);
    tiertest::tier_remove_dir(dir);
}

TEST_CASE("disk tier: byte limit evicts the least recently used file") {
    const std::string dir = tiertest::tier_scratch_dir("limit");
    tier::disk_tier d(dir, {.limit_bytes = 3 * 1000, .sync = false});
    std::vector<std::byte> b(1000);
    tier::blob_header h;
    CHECK(tier::read_blob_header(b, h) == tier::refusal::corrupt);
    // Disk files need a valid header for get(): build 1000-byte blobs.
    tiertest::tier_kv c(tiertest::tier_shape(1));
    std::vector<std::byte> blob;
    std::uint32_t n = 1;
    for (;; ++n) {  // the blob of n tokens closest to 1000 bytes from below
        c.clear();
        tiertest::tier_fill(c, 0, n, 1);
        const prompt_tokens p = tiertest::tier_prompt(n, 1);
        const auto fp = tier::memory_fingerprint(c);
        auto next = tier::make_blob(tier::key{}, fp, 0, 0, p, io::save_seq(c, 0));
        if (next.size() > 1000) break;
        blob = std::move(next);
    }
    REQUIRE(!blob.empty());
    std::vector<std::byte> out;
    for (int i = 0; i < 3; ++i) {
        REQUIRE(d.put(disk_key(i), blob));
        std::filesystem::last_write_time(d.path_of(disk_key(i)), std::filesystem::file_time_type::clock::now() -
                                                                     std::chrono::seconds(100 - i));
    }
    REQUIRE(d.get(disk_key(0), out));  // 0 becomes the most recent
    REQUIRE(d.put(disk_key(3), blob));
    CHECK(d.contains(disk_key(0)));
    CHECK_FALSE(d.contains(disk_key(1)));
    CHECK(d.contains(disk_key(2)));
    CHECK(d.contains(disk_key(3)));
    CHECK(d.stats().evictions == 1);
    CHECK(d.bytes() <= 3000);
    CHECK(d.erase(disk_key(3)));
    CHECK_FALSE(d.erase(disk_key(3)));
    CHECK_THROWS_AS(tier::disk_tier(""), kvcache::error);
    CHECK_THROWS_AS(tier::disk_tier("/proc/version/x"), kvcache::error);
    tiertest::tier_remove_dir(dir);
}

TEST_CASE("disk tier: four processes writing and reading one directory at once") {
    const std::string dir = tiertest::tier_scratch_dir("procs");
    tiertest::tier_kv c(tiertest::tier_shape(1));
    tiertest::tier_fill(c, 0, 64, 4);
    const prompt_tokens p = tiertest::tier_prompt(64, 4);
    std::vector<pid_t> kids;
    for (int w = 0; w < 4; ++w) {
        const pid_t pid = ::fork();
        if (pid == 0) {
            int rc = 0;
            try {
                disk_chain tc({.block_tokens = 16}, tier::disk_tier(dir, {.limit_bytes = 40000}));
                tiertest::tier_kv mine(tiertest::tier_shape(1));
                for (int i = 0; i < 40; ++i) {
                    // Same keys (the shared prompt at 16/32/48/64 tokens) and own keys (salt w).
                    prompt_tokens q = p;
                    q.keep_first(16 * (1 + i % 4));
                    REQUIRE(c.seq_rm(1, -1, -1));
                    REQUIRE(c.seq_cp(0, 1, 0, static_cast<pos_t>(q.size())));
                    static_cast<void>(tc.publish(c, 1, q, i % 2 == 0 ? 0 : static_cast<std::uint64_t>(w + 1)));
                    REQUIRE(mine.seq_rm(0, -1, -1));
                    const auto f = tc.fetch(mine, 0, p);
                    if (f.n_tokens > 0 && tiertest::tier_seq_bytes(mine, 0) != [&] {
                            tiertest::tier_kv ref(tiertest::tier_shape(1));
                            tiertest::tier_fill(ref, 0, 64, 4);
                            REQUIRE(ref.seq_rm(0, static_cast<pos_t>(f.n_tokens), -1));
                            return tiertest::tier_seq_bytes(ref, 0);
                        }())
                        rc = 3;  // wrong K/V: never
                }
                if (tc.metrics().tiers[0].refused_for(tier::refusal::corrupt) != 0) rc = 4;
                if (tc.metrics().fetch_hits == 0) rc = 5;
            } catch (...) {
                rc = 99;
            }
            ::_exit(rc);
        }
        kids.push_back(pid);
    }
    for (pid_t k : kids) {
        int st = 0;
        ::waitpid(k, &st, 0);
        CHECK(WIFEXITED(st));
        CHECK(WEXITSTATUS(st) == 0);
    }
    // Every file left is a whole blob; no temporary file is left.
    tier::disk_tier d(dir);
    d.scan_all();
    CHECK(d.stats().corrupt_removed == 0);
    CHECK(d.size() > 0);
    for (const auto& e : std::filesystem::directory_iterator(dir))
        CHECK_FALSE(e.path().filename().string().starts_with(".tmp-"));
    tiertest::tier_remove_dir(dir);
}
}
