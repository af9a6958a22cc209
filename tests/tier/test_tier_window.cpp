// Storage tiers under the slots on memories with a sliding window: kv_cache<ring<W>> and
// iswa_cache (full layers beside a ring of sliding-window layers). A blob of such a memory
// holds what the window kept; a request that extends the published tokens loads it whole
// and continues; an exact repeat (whose last position is computed) cuts it at the last
// position, which the window allows; a request diverging earlier misses. Every served
// sequence is compared, position by position and layer by layer, with the K/V a host
// computes for those tokens.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <vector>

#include "tier_test_util.hpp"

using namespace kvcache;

namespace {
constexpr std::uint32_t twin_w = 8;
using twin_ring = kv_cache<f32, ring<twin_w>, reuse::lcp>;
using twin_iswa = iswa_cache<twin_w, f32, reuse::lcp>;

model_shape twin_shape(std::uint32_t n_layer, std::uint32_t n_cells) {
    model_shape s = tiertest::tier_shape(n_layer);
    s.n_cells = n_cells;
    return s;
}
twin_ring twin_make_ring() { return twin_ring(twin_shape(2, ring<twin_w>::cells_for(4, 64))); }
twin_iswa twin_make_iswa() {
    iswa_shape s;
    s.shape = twin_shape(4, 256);
    s.swa_layers = iswa_shape::every_nth_full(4, 2);  // layers 1 and 3 full
    s.swa_n_cells = ring<twin_w>::cells_for(4, 64);
    return twin_iswa(s);
}

std::uint64_t twin_mix(std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/// The value a host computes for element j of layer l's K (or V) row at position i of p:
/// a function of the tokens [0, i], as a model's K/V are.
float twin_value(const prompt_tokens& p, std::size_t i, std::uint32_t l, std::size_t j, bool v) {
    std::uint64_t h = 0;
    for (std::size_t t = 0; t <= i; ++t) h = twin_mix(h ^ static_cast<std::uint64_t>(p[t]));
    const std::uint64_t x = twin_mix((v ? ~h : h) ^ (l * 1000003ull + j));
    return static_cast<float>(static_cast<double>(x >> 11) * 0x1.0p-53 * 4.0 - 2.0);
}

const model_shape& twin_model_shape(const twin_ring& c) { return c.shape(); }
const model_shape& twin_model_shape(const twin_iswa& c) { return c.full().shape(); }
std::uint32_t twin_layers(const twin_ring& c) { return c.shape().n_layer; }
std::uint32_t twin_layers(const twin_iswa& c) { return c.n_layer(); }

/// Computes positions [from, to) of p into seq, one position per micro-batch (a ring takes
/// at most its region's spare cells per batch).
template <class Cache>
void twin_fill(Cache& c, seq_id_t s, const prompt_tokens& p, std::size_t from, std::size_t to) {
    const model_shape& sh = twin_model_shape(c);
    for (std::size_t i = from; i < to; ++i) {
        const pos_t pos[1] = {static_cast<pos_t>(i)};
        const seq_id_t seq[1] = {s};
        auto r = c.place(pos, seq);
        REQUIRE(r);
        for (std::uint32_t l = 0; l < twin_layers(c); ++l) {
            std::vector<float> k(sh.k_row_size()), v(sh.v_row_size());
            for (std::size_t j = 0; j < k.size(); ++j) k[j] = twin_value(p, i, l, j, false);
            for (std::size_t j = 0; j < v.size(); ++j) v[j] = twin_value(p, i, l, j, true);
            if constexpr (std::same_as<Cache, twin_iswa>) {
                c.write_k(l, r.value(), k.data());
                c.write_v(l, r.value(), v.data());
            } else {
                c.write_k(l, r.value().cells, k.data());
                c.write_v(l, r.value().cells, v.data());
            }
        }
        static_cast<void>(c.commit());
    }
}

/// Every cell of seq in part holds exactly the K/V of its position in p (model layer
/// `layer_of(local)` for the part's local layer); returns the positions held, sorted.
template <class Part, class LayerOf>
std::vector<pos_t> twin_check_part(const Part& part, seq_id_t s, const prompt_tokens& p, LayerOf layer_of) {
    const model_shape& sh = part.shape();
    std::vector<pos_t> held;
    std::vector<float> row(std::max(sh.k_row_size(), sh.v_row_size()));
    for (std::uint32_t cell : part.cells().used_cells()) {
        if (!part.cells().seqs(cell).test(s)) continue;
        const pos_t pos = part.cells().pos(cell);
        held.push_back(pos);
        REQUIRE(static_cast<std::size_t>(pos) < p.size());
        for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
            part.read_k(l, cell, row.data());
            for (std::size_t j = 0; j < sh.k_row_size(); ++j)
                REQUIRE(row[j] == twin_value(p, static_cast<std::size_t>(pos), layer_of(l), j, false));
            part.read_v(l, cell, row.data());
            for (std::size_t j = 0; j < sh.v_row_size(); ++j)
                REQUIRE(row[j] == twin_value(p, static_cast<std::size_t>(pos), layer_of(l), j, true));
        }
    }
    std::sort(held.begin(), held.end());
    return held;
}

/// Whether held contains every position of [from, to).
bool twin_covers(const std::vector<pos_t>& held, std::int64_t from, std::int64_t to) {
    for (std::int64_t q = std::max<std::int64_t>(0, from); q < to; ++q)
        if (!std::binary_search(held.begin(), held.end(), static_cast<pos_t>(q))) return false;
    return true;
}

/// The sequence holds what a host needs to continue p: every position's K/V exact, the
/// full layers all of [0, n), the window layers at least the last W positions.
void twin_check(const twin_ring& c, seq_id_t s, const prompt_tokens& p) {
    const auto held = twin_check_part(c, s, p, [](std::uint32_t l) { return l; });
    const auto n = static_cast<std::int64_t>(p.size());
    CHECK(twin_covers(held, n - twin_w, n));
}
void twin_check(const twin_iswa& c, seq_id_t s, const prompt_tokens& p) {
    std::vector<std::uint32_t> full_layers, swa_layers;
    for (std::uint32_t l = 0; l < c.n_layer(); ++l) (c.is_swa(l) ? swa_layers : full_layers).push_back(l);
    const auto full = twin_check_part(c.full(), s, p, [&](std::uint32_t l) { return full_layers[l]; });
    const auto swa = twin_check_part(c.swa(), s, p, [&](std::uint32_t l) { return swa_layers[l]; });
    const auto n = static_cast<std::int64_t>(p.size());
    CHECK(twin_covers(full, 0, n));
    CHECK(full.size() == p.size());
    CHECK(twin_covers(swa, n - twin_w, n));
}

/// Serves p as a host does (prepare, compute the rest, commit, check, release).
template <class Cache>
prepared_request twin_serve(slot_manager<Cache>& sm, Cache& c, const prompt_tokens& p, const request_options& ro = {}) {
    auto r = sm.prepare(p, ro);
    REQUIRE(r);
    const prepared_request out = r.value();
    twin_fill(c, out.seq, p, out.n_past, p.size());
    sm.commit_prompt(out.slot);
    twin_check(c, out.seq, p);
    sm.release(out.slot);
    return out;
}

/// A process of the scenario: a fresh cache and slot manager on the shared chain.
template <class Cache>
struct twin_process {
    Cache cache;
    slot_manager<Cache> slots;
    twin_process(Cache (*make)(), tier::tier_cache<Cache, tier::memory_tier>& chain)
        : cache(make()), slots(cache, {.n_slots = 2}) {
        slots.attach_tiers(chain, {.scratch_seq = 3});
    }
    prepared_request serve(const prompt_tokens& p) { return twin_serve(slots, cache, p); }
};

template <class Cache>
void twin_run(Cache (*make)()) {
    using chain_t = tier::tier_cache<Cache, tier::memory_tier>;
    chain_t chain({.block_tokens = 8}, tier::memory_tier());
    const prompt_tokens req = tiertest::tier_prompt(40, 11);
    prompt_tokens longer = req;
    for (token_t t = 0; t < 10; ++t) longer.push_back(700 + t);

    // Process A: computes req (the window keeps the last positions only) and publishes it.
    twin_process<Cache> a(make, chain);
    CHECK(a.serve(req).n_past == 0);
    CHECK(chain.metrics().published == 1);

    // Process B (a fresh cache on the same chain): a request extending req loads the blob
    // whole and continues from position 40 with the window it needs.
    twin_process<Cache> b(make, chain);
    const auto q = b.serve(longer);
    CHECK(q.n_past == 40);
    CHECK(q.metrics.from_tier == 40);
    CHECK(q.metrics.tier == 0);
    CHECK(b.cache.seq_pos_max(3) < 0);  // scratch emptied

    // An exact repeat of req on another fresh cache: the last position is computed, so the
    // blob is cut at 39. A query at 39 sees keys (39 - W, 39], all in the blob: the window
    // layers accept the cut and the request reuses 39 positions, exact (serve checks every
    // held position and the window the next token needs).
    twin_process<Cache> c(make, chain);
    const auto e = c.serve(req);
    CHECK(e.n_past == 39);
    CHECK(e.metrics.from_tier == 39);
    CHECK(c.slots.metrics().tier_fetch_errors == 0);

    // A request diverging at 20 shares only blocks below the published key: a miss.
    prompt_tokens d = req;
    d.keep_first(20);
    for (token_t t = 0; t < 20; ++t) d.push_back(900 + t);
    twin_process<Cache> f(make, chain);
    const auto g = f.serve(d);
    CHECK(g.n_past == 0);
    CHECK(g.metrics.from_tier == 0);
}
}  // namespace

// (Registered under the tier_cache CTest suite: tests/CMakeLists.txt lists the tier suites.)
TEST_SUITE("tier_cache") {
TEST_CASE("slots + tiers on a ring layout: a blob of the window continues a longer request exactly") {
    twin_run<twin_ring>(&twin_make_ring);
}
TEST_CASE("slots + tiers on an ISWA cache: full and sliding-window parts come back from one blob") {
    twin_run<twin_iswa>(&twin_make_iswa);
}
}
