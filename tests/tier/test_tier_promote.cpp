// tier_cache promotion and zero-copy hits: deferred promotion (queued by fetch, run by
// promote_pending() and flush(), bounded by max_pending_bytes with drops counted, per-call
// override, one queue entry per key), mapped hits (disk_tier::map, memory_tier::map) equal
// to copied ones and surviving the file's removal, a corrupt or truncated mapped file
// refused and counted, and under slot_manager: a deferred promotion run by release(), a
// promotion that throws in release() counted and not thrown.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/tier/disk_tier.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <new>
#include <string>
#include <vector>

#include "tier_test_util.hpp"

using namespace kvcache;

namespace {
using promo_chain = tier::tier_cache<tiertest::tier_kv, tier::memory_tier, tier::disk_tier>;

/// A tier that has only the required members (no map(), no moving put): the copying path.
template <class T>
struct promo_get_only {
    T inner;
    result<void> put(const tier::key& k, std::span<const std::byte> b) { return inner.put(k, b); }
    bool get(const tier::key& k, std::vector<std::byte>& out) { return inner.get(k, out); }
    bool contains(const tier::key& k) const { return inner.contains(k); }
    bool erase(const tier::key& k) { return inner.erase(k); }
    std::size_t bytes() const { return inner.bytes(); }
    std::string_view name() const { return inner.name(); }
};
static_assert(tier::mappable_tier<tier::disk_tier> && tier::mappable_tier<tier::memory_tier>);
static_assert(!tier::mappable_tier<promo_get_only<tier::disk_tier>>);

/// Sequence dst's bytes after a cold fill of n positions (seed), the first keep of them kept.
std::vector<std::byte> promo_expected(seq_id_t dst, std::uint32_t n, std::uint32_t seed, std::uint32_t keep = UINT32_MAX) {
    tiertest::tier_kv ref(tiertest::tier_shape());
    tiertest::tier_fill(ref, dst, n, seed);
    if (keep < n) REQUIRE(ref.seq_rm(dst, static_cast<pos_t>(keep), -1));
    return tiertest::tier_seq_bytes(ref, dst);
}

tier::key promo_key(const tiertest::tier_kv& c, const prompt_tokens& p, std::uint32_t block) {
    return tier::block_keys(p, block, tier::memory_fingerprint(c), 0).back().k;
}

std::vector<std::byte> promo_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::byte> out(b.size());
    for (std::size_t i = 0; i < b.size(); ++i) out[i] = static_cast<std::byte>(b[i]);
    return out;
}

}  // namespace

TEST_SUITE("tier_cache") {
TEST_CASE("tier_cache: deferred promotion is queued, run by promote_pending and flush, bounded and counted") {
    const std::string dir = tiertest::tier_scratch_dir("promote");
    const prompt_tokens p = tiertest::tier_prompt(64, 5), q = tiertest::tier_prompt(64, 6);
    tiertest::tier_kv c(tiertest::tier_shape()), d(tiertest::tier_shape());
    tiertest::tier_fill(c, 0, 64, 5);
    tiertest::tier_fill(d, 0, 64, 6);
    const tier::key kp = promo_key(c, p, 32), kq = promo_key(d, q, 32);
    promo_chain tc({.block_tokens = 32, .promote = tier::promotion::deferred}, tier::memory_tier(),
                   tier::disk_tier(dir, {.sync = false}));
    REQUIRE(tc.publish(c, 0, p).stored);
    REQUIRE(tc.publish(d, 0, q).stored);
    const std::vector<std::byte> blob_p = promo_file(tc.get<1>().path_of(kp));
    REQUIRE(tc.get<0>().erase(kp));
    REQUIRE(tc.get<0>().erase(kq));

    // A disk hit: loaded now, the promotion queued (the memory tier does not hold it yet).
    tier::fetch_info f = tc.fetch(c, 1, p);
    CHECK(f.tier == 1);
    CHECK(f.n_tokens == 64);
    CHECK(tiertest::tier_seq_bytes(c, 1) == promo_expected(1, 64, 5));
    REQUIRE(c.seq_rm(1, -1, -1));
    CHECK_FALSE(tc.get<0>().contains(kp));
    auto m = tc.metrics();
    CHECK(m.promotions_deferred == 1);
    CHECK(m.pending_promotions == 1);
    CHECK(m.pending_bytes == blob_p.size());
    CHECK(m.tiers[0].promotions == 0);
    // The same key again before the queue runs: one entry per key.
    CHECK(tc.fetch(c, 1, p).tier == 1);
    REQUIRE(c.seq_rm(1, -1, -1));
    CHECK(tc.metrics().pending_promotions == 1);
    CHECK(tc.metrics().promotions_deferred == 1);
    // promote_pending writes it; the memory tier then serves it, the same bytes.
    CHECK(tc.promote_pending() == 1);
    m = tc.metrics();
    CHECK(m.pending_promotions == 0);
    CHECK(m.pending_bytes == 0);
    CHECK(m.tiers[0].promotions == 1);
    std::vector<std::byte> held;
    REQUIRE(tc.get<0>().get(kp, held));
    CHECK(held == blob_p);
    CHECK(tc.fetch(c, 1, p).tier == 0);
    CHECK(tiertest::tier_seq_bytes(c, 1) == promo_expected(1, 64, 5));
    REQUIRE(c.seq_rm(1, -1, -1));
    CHECK(tc.promote_pending() == 0);

    // flush() runs the queue too (and writes no write-back entry: write_through).
    REQUIRE(tc.get<0>().erase(kp));
    CHECK(tc.fetch(c, 1, p).tier == 1);
    REQUIRE(c.seq_rm(1, -1, -1));
    CHECK(tc.flush() == 0);
    CHECK(tc.get<0>().contains(kp));
    CHECK(tc.metrics().pending_promotions == 0);

    // Per-call override: immediate although the options defer.
    REQUIRE(tc.get<0>().erase(kp));
    CHECK(tc.fetch(c, 1, p, 0, SIZE_MAX, tier::promotion::immediate).tier == 1);
    REQUIRE(c.seq_rm(1, -1, -1));
    CHECK(tc.get<0>().contains(kp));
    CHECK(tc.metrics().pending_promotions == 0);
    CHECK(tc.metrics().tiers[0].promotions == 3);

    // The byte bound: room for one blob; the second is dropped and counted, the fetch still hits.
    promo_chain small({.block_tokens = 32, .max_pending_bytes = blob_p.size()}, tier::memory_tier(),
                      tier::disk_tier(dir, {.sync = false}));
    CHECK(small.fetch(c, 1, p, 0, SIZE_MAX, tier::promotion::deferred).tier == 1);  // override of immediate
    REQUIRE(c.seq_rm(1, -1, -1));
    CHECK(small.metrics().pending_promotions == 1);
    f = small.fetch(d, 1, q, 0, SIZE_MAX, tier::promotion::deferred);
    CHECK(f.tier == 1);
    CHECK(tiertest::tier_seq_bytes(d, 1) == promo_expected(1, 64, 6));
    REQUIRE(d.seq_rm(1, -1, -1));
    m = small.metrics();
    CHECK(m.promotions_deferred == 1);
    CHECK(m.promotions_dropped == 1);
    CHECK(m.pending_promotions == 1);
    CHECK(small.promote_pending() == 1);
    CHECK(small.get<0>().contains(kp));
    CHECK_FALSE(small.get<0>().contains(kq));
    // Without an override the options' immediate promotion applies.
    CHECK(small.fetch(d, 1, q).tier == 1);
    REQUIRE(d.seq_rm(1, -1, -1));
    CHECK(small.get<0>().contains(kq));
    const std::string text = tier::to_prometheus(small.metrics());
    CHECK(text.find("kvcache_tier_promotions_dropped_total 1\n") != std::string::npos);
    CHECK(text.find("kvcache_tier_promotions_deferred_total 1\n") != std::string::npos);
    CHECK(text.find("# TYPE kvcache_tier_pending_promotion_bytes gauge\nkvcache_tier_pending_promotion_bytes 0\n") !=
          std::string::npos);
    tiertest::tier_remove_dir(dir);
}

TEST_CASE("tier_cache: mapped hits equal copied hits; a mapping outlives the file's removal") {
    const std::string dir = tiertest::tier_scratch_dir("mapped");
    const prompt_tokens p = tiertest::tier_prompt(96, 8);
    tiertest::tier_kv c(tiertest::tier_shape());
    tiertest::tier_fill(c, 0, 96, 8);
    const tier::key k = promo_key(c, p, 32);
    tier::tier_cache<tiertest::tier_kv, tier::disk_tier> mapped_chain({.block_tokens = 32},
                                                                      tier::disk_tier(dir, {.sync = false}));
    REQUIRE(mapped_chain.publish(c, 0, p).stored);
    // The tiers' map() against their get().
    tier::disk_tier& disk = mapped_chain.get<0>();
    std::vector<std::byte> copied;
    REQUIRE(disk.get(k, copied));
    tier::mapped_blob m;
    REQUIRE(disk.map(k, m));
    CHECK(m.owns());
    CHECK(std::vector<std::byte>(m.bytes().begin(), m.bytes().end()) == copied);
    tier::memory_tier mem;
    REQUIRE(mem.put(k, copied));
    tier::mapped_blob lent;
    REQUIRE(mem.map(k, lent));
    CHECK_FALSE(lent.owns());
    CHECK(std::vector<std::byte>(lent.bytes().begin(), lent.bytes().end()) == copied);
    CHECK_FALSE(mem.map(tier::key{}, lent));
    tier::mapped_blob none;
    CHECK_FALSE(disk.map(tier::key{}, none));
    // memory_tier::put by rvalue keeps the vector itself.
    std::vector<std::byte> moved = copied;
    const std::byte* where = moved.data();
    REQUIRE(mem.put(k, std::move(moved)));
    REQUIRE(mem.map(k, lent));
    CHECK(lent.bytes().data() == where);
    CHECK(mem.bytes() == copied.size());
    CHECK_FALSE(tier::memory_tier(16).put(k, std::vector<std::byte>(copied)));  // over the limit: no_space
    // A fetch through map() and one through get() load the same K/V.
    tier::tier_cache<tiertest::tier_kv, promo_get_only<tier::disk_tier>> copying_chain(
        {.block_tokens = 32}, promo_get_only<tier::disk_tier>{tier::disk_tier(dir, {.sync = false})});
    for (std::size_t cap : {std::size_t{95}, std::size_t{96}, std::size_t{50}}) {
        CAPTURE(cap);
        const auto a = mapped_chain.fetch(c, 1, p, 0, cap);  // (a load needs room for all 96 cells)
        CHECK(a.n_tokens == std::min<std::size_t>(cap, 96));
        const std::vector<std::byte> got_a = tiertest::tier_seq_bytes(c, 1);
        REQUIRE(c.seq_rm(1, -1, -1));
        const auto b = copying_chain.fetch(c, 1, p, 0, cap);
        CHECK(b.n_tokens == a.n_tokens);
        CHECK(tiertest::tier_seq_bytes(c, 1) == got_a);
        CHECK(got_a == promo_expected(1, 96, 8, a.n_tokens));
        REQUIRE(c.seq_rm(1, -1, -1));
    }
    // A mapping stays readable when the file is removed (unlink) meanwhile.
    REQUIRE(disk.map(k, m));
    REQUIRE(disk.erase(k));
    CHECK_FALSE(disk.contains(k));
    CHECK(std::vector<std::byte>(m.bytes().begin(), m.bytes().end()) == copied);
    tier::mapped_blob moved_m = std::move(m);
    CHECK(m.size() == 0);
    CHECK(moved_m.size() == copied.size());
    tiertest::tier_remove_dir(dir);
}

TEST_CASE("tier_cache: a corrupt or truncated mapped file is refused, counted and removed") {
    const std::string dir = tiertest::tier_scratch_dir("mapped_bad");
    const prompt_tokens p = tiertest::tier_prompt(64, 12);
    tiertest::tier_kv c(tiertest::tier_shape());
    tiertest::tier_fill(c, 0, 64, 12);
    const tier::key k = promo_key(c, p, 32);
    tier::tier_cache<tiertest::tier_kv, tier::disk_tier> tc({.block_tokens = 32}, tier::disk_tier(dir, {.sync = false}));
    auto corrupt_at = [&](std::size_t at) {
        REQUIRE(tc.publish(c, 0, p).stored);
        const std::string path = tc.get<0>().path_of(k);
        std::vector<std::byte> b = promo_file(path);
        REQUIRE(at < b.size());
        b[at] ^= std::byte{0x40};
        std::ofstream out(path, std::ios::binary | std::ios::trunc);
        out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    };
    const auto before = io::save_state(c);
    // A flipped payload byte: the checksum refuses it; the file is erased.
    corrupt_at(2000);
    CHECK(tc.fetch(c, 1, p).n_tokens == 0);
    CHECK(io::save_state(c) == before);
    CHECK(tc.metrics().tiers[0].refused_for(tier::refusal::corrupt) == 1);
    CHECK_FALSE(tc.get<0>().contains(k));
    // A flipped magic byte: map() itself refuses the header and removes the file.
    corrupt_at(0);
    tier::mapped_blob m;
    CHECK_FALSE(tc.get<0>().map(k, m));
    CHECK(m.size() == 0);
    CHECK(tc.get<0>().stats().corrupt_removed == 1);
    CHECK_FALSE(tc.get<0>().contains(k));
    // Truncated files (shorter than the header; shorter than the header says): removed.
    for (std::uintmax_t len : {std::uintmax_t{40}, std::uintmax_t{500}}) {
        CAPTURE(len);
        REQUIRE(tc.publish(c, 0, p).stored);
        std::filesystem::resize_file(tc.get<0>().path_of(k), len);
        CHECK(tc.fetch(c, 1, p).n_tokens == 0);
        CHECK_FALSE(tc.get<0>().contains(k));
    }
    CHECK(tc.get<0>().stats().corrupt_removed == 3);
    CHECK(io::save_state(c) == before);
    // A good copy again: hit.
    REQUIRE(tc.publish(c, 0, p).stored);
    CHECK(tc.fetch(c, 1, p).n_tokens == 64);
    tiertest::tier_remove_dir(dir);
}

TEST_CASE("slots + tiers: prepare defers the promotion, release runs it; a promotion that throws is counted") {
    using cache_t = kv_cache<f16, reuse::global<>>;
    using chain_t = tier::tier_cache<cache_t, tiertest::throwing_tier, tier::memory_tier>;
    const prompt_tokens req = tiertest::tier_prompt(64, 31);
    // The blob of req, in the lower (memory) tier only.
    bool fail = false;
    chain_t tc({.block_tokens = 16}, tiertest::throwing_tier{&fail, tier::memory_tier()}, tier::memory_tier());
    cache_t src(tiertest::tier_shape());
    {
        std::vector<pos_t> pos;
        for (pos_t i = 0; i < 64; ++i) pos.push_back(i);
        std::vector<seq_id_t> seq(pos.size(), 0);
        auto r = src.place(pos, seq);
        REQUIRE(r);
        std::vector<float> kv(64 * src.shape().k_row_size(), 0.25f);
        for (std::uint32_t l = 0; l < src.shape().n_layer; ++l) {
            src.write_k(l, r.value().cells, kv.data());
            src.write_v(l, r.value().cells, kv.data());
        }
        static_cast<void>(src.commit());
    }
    tier::tier_cache<cache_t, tier::memory_tier> pub({.block_tokens = 16}, tier::memory_tier());
    REQUIRE(pub.publish(src, 0, req).stored);
    const tier::key k = tier::block_keys(req, 16, tier::memory_fingerprint(src), 0).back().k;
    std::vector<std::byte> blob;
    REQUIRE(pub.get<0>().get(k, blob));
    REQUIRE(tc.get<1>().put(k, blob));

    auto serve = [&](cache_t& c, slot_manager<cache_t>& sm, bool fail_release) {
        const auto p = sm.prepare(req).value();
        CHECK(p.metrics.from_tier == 63);
        CHECK(p.metrics.tier == 1);
        CHECK(tc.metrics().pending_promotions == 1);  // deferred: not yet in tier 0
        CHECK_FALSE(tc.get<0>().contains(k));
        std::vector<pos_t> pos{63};
        std::vector<seq_id_t> seq{p.seq};
        REQUIRE(c.place(pos, seq));
        static_cast<void>(c.commit());
        sm.commit_prompt(p.slot);
        fail = fail_release;
        CHECK_NOTHROW(sm.release(p.slot));
        fail = false;
        CHECK_FALSE(sm.busy(p.slot));
        CHECK(tc.metrics().pending_promotions == 0);
    };
    {  // The promotion throws inside release(): counted, the release completes.
        cache_t c(tiertest::tier_shape());
        slot_manager<cache_t> sm(c, {.n_slots = 2});
        sm.attach_tiers(tc, {.scratch_seq = 3, .publish_on_release = false});
        serve(c, sm, true);
        CHECK(sm.metrics().tier_publish_errors == 1);
        CHECK_FALSE(tc.get<0>().contains(k));
        CHECK(tc.metrics().tiers[0].promotions == 0);
    }
    {  // A fresh cache: the same hit, now promoted by release().
        cache_t c(tiertest::tier_shape());
        slot_manager<cache_t> sm(c, {.n_slots = 2});
        sm.attach_tiers(tc, {.scratch_seq = 3, .publish_on_release = false});
        serve(c, sm, false);
        CHECK(sm.metrics().tier_publish_errors == 0);
        CHECK(tc.get<0>().contains(k));
        CHECK(tc.metrics().tiers[0].promotions == 1);
    }
    {  // promote = immediate in the hook options: tier 0 holds it right after prepare.
        REQUIRE(tc.get<0>().erase(k));
        cache_t c(tiertest::tier_shape());
        slot_manager<cache_t> sm(c, {.n_slots = 2});
        sm.attach_tiers(tc, {.scratch_seq = 3, .publish_on_release = false, .promote = tier::promotion::immediate});
        const auto p = sm.prepare(req).value();
        CHECK(p.metrics.tier == 1);
        CHECK(tc.get<0>().contains(k));
        CHECK(tc.metrics().pending_promotions == 0);
    }
}
}

namespace {
using room_cache = kv_cache<f16, reuse::lcp>;

/// Serves p on slot_manager sm as a host does, with K/V of a constant per prompt: prepare,
/// place the rest, commit, release. Returns the prepared request.
prepared_request room_serve(slot_manager<room_cache>& sm, room_cache& c, const prompt_tokens& p) {
    const prepared_request r = sm.prepare(p).value();
    std::vector<pos_t> pos;
    for (std::size_t i = r.n_past; i < p.size(); ++i) pos.push_back(static_cast<pos_t>(i));
    std::vector<seq_id_t> seq(pos.size(), r.seq);
    const auto placed = c.place(pos, seq);
    REQUIRE(placed);
    std::vector<float> kv(pos.size() * c.shape().k_row_size(), static_cast<float>(p[0] % 7) * 0.125f);
    for (std::uint32_t l = 0; l < c.shape().n_layer; ++l) {
        c.write_k(l, placed.value().cells, kv.data());
        c.write_v(l, placed.value().cells, kv.data());
    }
    static_cast<void>(c.commit());
    sm.commit_prompt(r.slot);
    sm.release(r.slot);
    return r;
}
}  // namespace

TEST_SUITE("tier_cache") {
TEST_CASE("tier_cache: a blob without room is reported (fetch_info::no_room); prepare evicts idle states and retries") {
    auto shape = tiertest::tier_shape();
    shape.n_cells = 160;
    const prompt_tokens req = tiertest::tier_prompt(100, 40), a = tiertest::tier_prompt(70, 41), b = tiertest::tier_prompt(70, 42);
    // The blob of req (99 positions after the cap), computed in another cache.
    room_cache src(shape);
    tier::tier_cache<room_cache, tier::memory_tier> tc({.block_tokens = 16}, tier::memory_tier());
    {
        slot_manager<room_cache> s0(src, {.n_slots = 1});
        room_serve(s0, src, req);
        REQUIRE(tc.publish(src, 0, req).stored);
    }
    room_cache c(shape);
    slot_manager<room_cache> sm(c, {.n_slots = 3});
    room_serve(sm, c, a);
    room_serve(sm, c, b);  // two idle slots hold 140 of the 160 cells
    // The chain alone: no room for the 100-position blob, reported, nothing loaded.
    const tier::fetch_info f = tc.fetch(c, 3, req, 0, 99);
    CHECK(f.n_tokens == 0);
    CHECK(f.no_room == 100);  // the blob under the longest key (96) holds all 100 positions
    CHECK(c.seq_pos_max(3) < 0);
    CHECK(tc.metrics().tiers[0].refused_for(tier::refusal::load) >= 1);
    // Under the slot manager: make_room evicts idle states, the retry loads 99 positions.
    sm.attach_tiers(tc, {.scratch_seq = 3, .publish_on_release = false});
    const prepared_request r = sm.prepare(req).value();
    CHECK(r.metrics.from_tier == 99);
    CHECK(r.metrics.tier == 0);
    CHECK(sm.metrics().slot_states_evicted >= 1);
    CHECK(c.seq_pos_max(3) < 0);
    std::vector<std::byte> want;
    {
        room_cache ref(shape);
        slot_manager<room_cache> s0(ref, {.n_slots = 1});
        room_serve(s0, ref, req);
        REQUIRE(ref.seq_rm(0, 99, -1));
        if (r.seq != 0) REQUIRE(ref.seq_cp(0, r.seq, -1, -1));
        if (r.seq != 0) REQUIRE(ref.seq_rm(0, -1, -1));
        want = io::save_seq(ref, r.seq);
    }
    CHECK(io::save_seq(c, r.seq) == want);
}
}
