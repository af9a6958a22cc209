// State round trips (F15): save -> load -> save is byte-identical, every cell (position,
// pending shift, sequences, raw K/V) and the attention oracle agree, one sequence loads
// into a cache holding others without touching them, and removing one sequence does not
// change another sequence's saved bytes.
//
// Replay: the seed of each case is printed (KVCACHE_TEST_SEED overrides the base seed).
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cstdlib>
#include <random>
#include <vector>

#include "io/io_test_util.hpp"
#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvtest;
namespace io = kvcache::io;

std::uint32_t base_seed() {
    const char* v = std::getenv("KVCACHE_TEST_SEED");
    return v != nullptr ? static_cast<std::uint32_t>(std::strtoul(v, nullptr, 10)) : 20261122u;
}

std::vector<kvcache::token_t> random_tokens(std::mt19937& rng, std::size_t n) {
    std::vector<kvcache::token_t> t(n);
    for (auto& x : t) x = static_cast<kvcache::token_t>(rng() % 32000);
    return t;
}

template <class Cache>
kvcache::model_shape shape_for() {
    // f32 with head_dim_v != head_dim_k and a capacity (72) that is not a multiple of the K tile; the others with equal dims.
    if constexpr (std::is_same_v<typename Cache::element, kvcache::f32>) return io_shape(72, 4, 2, 2, 8, 12);
    return io_shape(64, 4, 3, 2, 8);
}

using kv_f32 = kvcache::kv_cache<kvcache::f32>;
using kv_f16 = kvcache::kv_cache<kvcache::f16>;
using kv_bf16_vt = kvcache::kv_cache<kvcache::bf16, kvcache::contiguous<kvcache::v_layout::transposed>>;
using kv_f16_vt = kvcache::kv_cache<kvcache::contiguous<kvcache::v_layout::transposed>, kvcache::f16>;

}  // namespace

TEST_CASE_TEMPLATE("whole-cache round trip is byte-identical and preserves every cell", Cache, kv_f32, kv_f16,
                   kv_bf16_vt, kv_f16_vt) {
    const kvcache::model_shape sh = shape_for<Cache>();
    for (std::uint32_t round = 0; round < 12; ++round) {
        const std::uint32_t seed = base_seed() + round;
        INFO("seed " << seed);
        std::mt19937 rng(seed);
        Cache c(sh);
        random_history(c, rng, 10 + static_cast<int>(round) * 4);
        const auto tokens = random_tokens(rng, rng() % 40);
        const auto bytes = io::save_state(c, tokens);
        CHECK(bytes.size() == io::state_size(c, tokens));

        Cache d(sh);
        std::mt19937 other(seed ^ 0x9e3779b9u);
        random_history(d, other, 8);  // whatever d held is replaced
        auto r = io::load_state(d, bytes);
        REQUIRE_MESSAGE(r.ok(), r.message());
        CHECK(r.value().tokens == tokens);
        CHECK(r.value().cells.size() == c.used());
        CHECK(d.used() == c.used());
        CHECK(picture(d) == picture(c));
        CHECK(io::save_state(d, tokens) == bytes);
        CHECK(d.has_shift() == c.has_shift());

        for (seq_id_t s = 0; s < static_cast<seq_id_t>(sh.n_seq_max); ++s) {
            CHECK(d.seq_pos_min(s) == c.seq_pos_min(s));
            CHECK(d.seq_pos_max(s) == c.seq_pos_max(s));
            if (c.seq_pos_max(s) < 0) continue;
            std::vector<float> q(sh.k_row_size());
            std::uniform_real_distribution<float> u(-1.0f, 1.0f);
            for (auto& x : q) x = u(rng);
            const pos_t p = c.seq_pos_max(s);
            CHECK(attention_oracle(d, s, p, q) == attention_oracle(c, s, p, q));
        }
        // The loaded cache keeps working: appending after the loaded cells.
        for (seq_id_t s = 0; s < static_cast<seq_id_t>(sh.n_seq_max); ++s)
            if (d.cells().free_count() > 0) CHECK(append(d, s, 1, rng));
    }
}

TEST_CASE_TEMPLATE("one-sequence round trip, into a cache that holds other sequences", Cache, kv_f32, kv_f16,
                   kv_bf16_vt) {
    const kvcache::model_shape sh = shape_for<Cache>();
    for (std::uint32_t round = 0; round < 12; ++round) {
        const std::uint32_t seed = base_seed() + 100 + round;
        INFO("seed " << seed);
        std::mt19937 rng(seed);
        Cache c(sh);
        random_history(c, rng, 16);
        for (seq_id_t s = 0; s < static_cast<seq_id_t>(sh.n_seq_max); ++s) {
            const auto bytes = io::save_seq(c, s, {});
            CHECK(bytes.size() == io::seq_state_size(c, s));

            // Into an empty cache, same sequence id: byte-identical again.
            Cache e(sh);
            auto r = io::load_seq(e, s, bytes);
            REQUIRE_MESSAGE(r.ok(), r.message());
            CHECK(r.value().saved_seq == s);
            CHECK(io::save_seq(e, s) == bytes);
            CHECK(picture(e, s, s) == picture(c, s, s));

            // Into a busy cache under another id: dst replaced, every other sequence untouched.
            Cache d(sh);
            std::mt19937 other(seed * 7 + static_cast<std::uint32_t>(s));
            random_history(d, other, 10);
            const seq_id_t dst = (s + 1) % static_cast<seq_id_t>(sh.n_seq_max);
            std::vector<std::vector<cell_picture>> before;
            for (seq_id_t t = 0; t < static_cast<seq_id_t>(sh.n_seq_max); ++t) before.push_back(picture(d, t, t));
            const auto snap = snapshot(d);
            auto r2 = io::load_seq(d, dst, bytes);
            if (!r2) {  // only possible reason: not enough free cells; then nothing changed
                CHECK(r2.code() == kvcache::errc::no_space);
                CHECK(snapshot(d) == snap);
                continue;
            }
            CHECK(picture(d, dst, dst) == picture(c, s, dst));
            for (seq_id_t t = 0; t < static_cast<seq_id_t>(sh.n_seq_max); ++t)
                if (t != dst) CHECK(picture(d, t, t) == before[static_cast<std::size_t>(t)]);
            if (c.seq_pos_max(s) >= 0) {
                std::vector<float> q(sh.k_row_size(), 0.25f);
                CHECK(attention_oracle(d, dst, c.seq_pos_max(s), q) == attention_oracle(c, s, c.seq_pos_max(s), q));
            }
        }
    }
}

TEST_CASE("removing one sequence does not change another sequence's saved bytes") {
    for (std::uint32_t round = 0; round < 10; ++round) {
        const std::uint32_t seed = base_seed() + 200 + round;
        INFO("seed " << seed);
        std::mt19937 rng(seed);
        kv_f16 c(io_shape(64, 4));
        random_history(c, rng, 20);
        std::vector<std::vector<std::byte>> saved;
        for (seq_id_t s = 0; s < 4; ++s) saved.push_back(io::save_seq(c, s));
        const seq_id_t gone = static_cast<seq_id_t>(rng() % 4);
        REQUIRE(c.seq_rm(gone, -1, -1));
        for (seq_id_t s = 0; s < 4; ++s)
            if (s != gone) CHECK(io::save_seq(c, s) == saved[static_cast<std::size_t>(s)]);
    }
}

TEST_CASE("tokens and media chunks round trip with the state") {
    kv_f16 c(io_shape(32, 2));
    std::mt19937 rng(base_seed() + 300);
    append(c, 0, 10, rng);
    const std::vector<kvcache::token_t> tokens{5, 6, -1, -1, -1, 7, 8, -1, 9, 10};
    const std::vector<kvcache::media_chunk> media{{0xabcdefu, 2, 3}, {42u, 7, 1}};
    for (bool whole : {true, false}) {
        const auto bytes = whole ? io::save_state(c, tokens, media) : io::save_seq(c, 0, tokens, media);
        kv_f16 d(io_shape(32, 2));
        auto r = whole ? io::load_state(d, bytes) : io::load_seq(d, 1, bytes);
        REQUIRE_MESSAGE(r.ok(), r.message());
        CHECK(r.value().tokens == tokens);
        CHECK(r.value().media == media);
        CHECK(r.value().kind == (whole ? io::state_kind::whole_cache : io::state_kind::one_sequence));
    }
}

TEST_CASE("duplicate (sequence, position) pairs that seq_div creates round trip") {
    kv_f32 c(io_shape(32, 2));
    std::mt19937 rng(base_seed() + 400);
    append(c, 0, 8, rng);
    REQUIRE(c.seq_div(0, 0, -1, 2));  // positions 0..7 -> 0,0,1,1,2,2,3,3
    for (bool clear_shift : {false, true}) {
        if (clear_shift) c.clear_shifts();
        const auto bytes = io::save_state(c);
        kv_f32 d(io_shape(32, 2));
        auto r = io::load_state(d, bytes);
        REQUIRE_MESSAGE(r.ok(), r.message());
        CHECK(picture(d) == picture(c));
        CHECK(io::save_state(d) == bytes);
    }
}

TEST_CASE("an empty cache and an empty sequence round trip") {
    kv_f16 c(io_shape(16, 2));
    const auto whole = io::save_state(c);
    CHECK(whole.size() == io::state_header_size + io::state_checksum_size);
    kv_f16 d(io_shape(16, 2));
    std::mt19937 rng(base_seed() + 500);
    append(d, 0, 5, rng);
    append(d, 1, 3, rng);
    REQUIRE(io::load_state(d, whole).ok());
    CHECK(d.used() == 0);
    append(d, 1, 3, rng);
    REQUIRE(io::load_seq(d, 1, io::save_seq(c, 0)).ok());  // loading an empty sequence clears dst
    CHECK(d.used() == 0);
}

TEST_CASE("save into a caller buffer; host-argument errors throw") {
    kv_f16 c(io_shape(16, 2));
    std::mt19937 rng(base_seed() + 600);
    append(c, 0, 5, rng);
    std::vector<std::byte> buf(io::state_size(c));
    io::save_state_into(c, buf);
    CHECK(buf == io::save_state(c));
    std::vector<std::byte> small(buf.size() - 1);
    CHECK_THROWS_AS(io::save_state_into(c, small), kvcache::error);
    CHECK_THROWS_AS(static_cast<void>(io::save_seq(c, 2)), kvcache::error);
    CHECK_THROWS_AS(static_cast<void>(io::save_seq(c, -1)), kvcache::error);
    const std::vector<kvcache::token_t> bad{1, -7};
    CHECK_THROWS_AS(static_cast<void>(io::save_state(c, bad)), kvcache::error);
    const std::vector<kvcache::token_t> toks{1, 2};
    const std::vector<kvcache::media_chunk> media{{1, 1, 3}};
    CHECK_THROWS_AS(static_cast<void>(io::save_state(c, toks, media)), kvcache::error);
    const auto bytes = io::save_seq(c, 0);
    kv_f16 d(io_shape(16, 2));
    CHECK_THROWS_AS(static_cast<void>(io::load_seq(d, 2, bytes)), kvcache::error);
    CHECK_THROWS_AS(static_cast<void>(io::load_seq(d, -1, bytes)), kvcache::error);
    const std::vector<pos_t> pos{0};
    const std::vector<seq_id_t> seq{1};
    REQUIRE(d.place(pos, seq).ok());  // a transaction is open: loading is refused
    CHECK_THROWS_AS(static_cast<void>(io::load_seq(d, 0, bytes)), kvcache::error);
    CHECK_THROWS_AS(static_cast<void>(io::load_state(d, io::save_state(c))), kvcache::error);
    CHECK_THROWS_AS(static_cast<void>(io::save_state(d)), kvcache::error);
    static_cast<void>(d.restore());
}

TEST_CASE_TEMPLATE("NeoX caches keep K rows in pair order; their states keep dimension order", Cache, kv_f32,
                   kv_f16_vt) {
    // Same history in a normal-RoPE and a NeoX cache: the states differ only in the
    // fingerprint's rope type and the checksum, and the NeoX state round trips.
    for (std::uint32_t n_rot : {0u, 4u}) {
        for (std::uint32_t round = 0; round < 4; ++round) {
            const std::uint32_t seed = base_seed() + 600 + round;
            INFO("seed " << seed << " n_rot " << n_rot);
            kvcache::model_shape sn = io_shape(61, 3, 2, 2, 8);
            sn.rope.n_rot = n_rot;
            kvcache::model_shape sx = sn;
            sx.rope.type = kvcache::rope_type::neox;
            Cache cn(sn), cx(sx);
            std::mt19937 rn(seed), rx(seed);
            random_history(cn, rn, 14);
            random_history(cx, rx, 14);
            REQUIRE(picture(cn) == picture(cx));  // same K/V by dimension
            std::vector<std::vector<std::byte>> saves_n{io::save_state(cn)}, saves_x{io::save_state(cx)};
            for (seq_id_t s = 0; s < 3; ++s) {
                saves_n.push_back(io::save_seq(cn, s));
                saves_x.push_back(io::save_seq(cx, s));
            }
            for (std::size_t i = 0; i < saves_n.size(); ++i) {
                const auto& a = saves_n[i];
                const auto& b = saves_x[i];
                REQUIRE(a.size() == b.size());
                std::size_t differ = 0;
                const std::size_t rope_at = io::detail::off::rope_type;  // u32 0 vs 1: its first byte
                for (std::size_t o = 0; o < a.size(); ++o)
                    if (a[o] != b[o] && o != rope_at && o < a.size() - io::state_checksum_size) ++differ;
                CHECK(differ == 0);
            }
            Cache d(sx);
            auto r = io::load_state(d, saves_x[0]);
            REQUIRE_MESSAGE(r.ok(), r.message());
            CHECK(picture(d) == picture(cx));
            CHECK(io::save_state(d) == saves_x[0]);
            Cache e(sx);
            REQUIRE(io::load_seq(e, 1, saves_x[1]).ok());  // one sequence: lanes moved one by one
            CHECK(picture(e, 1, 1) == picture(cx, 0, 1));
        }
    }
}

TEST_CASE("the format's 16-cell K tiles land in either half of the cache's 32-cell tiles, both pair layouts") {
    for (auto rope : {kvcache::rope_type::normal, kvcache::rope_type::neox}) {
        CAPTURE(static_cast<int>(rope));
        auto sh = io_shape(128, 2, 2, 2, 8);
        sh.rope.type = rope;
        using Cache = kvcache::kv_cache<kvcache::f16>;
        Cache a(sh), b(sh);
        std::mt19937 rng(base_seed() + 61);
        REQUIRE(append(a, 1, 16, rng));  // cells [0, 16): sequence 0 starts in the second half of tile 0
        REQUIRE(append(a, 0, 48, rng));  // cells [16, 64)
        REQUIRE(append(b, 1, 3, rng));   // b: sequence 0 will start at cell 3, unaligned (lanes moved one by one)
        const auto saved = io::save_seq(a, 0);
        auto r = io::load_seq(b, 0, saved);
        REQUIRE_MESSAGE(r.ok(), r.message());
        Cache c(sh);  // c: sequence 0 at cells [0, 48): first half of tile 0, tile 1 split in halves
        r = io::load_seq(c, 0, saved);
        REQUIRE_MESSAGE(r.ok(), r.message());
        // Every position of sequence 0 holds the same K/V in a, b and c, dimension by dimension.
        std::vector<float> ka(sh.k_row_size()), kx(ka.size()), va(sh.v_row_size()), vx(va.size());
        for (const Cache* x : {&b, &c})
            for (std::uint32_t ca = 16; ca < 64; ++ca) {
                std::uint32_t cx = 0;
                while (x->cells().pos(cx) != a.cells().pos(ca) || !x->cells().seqs(cx).test(0)) ++cx;
                for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
                    a.read_k(l, ca, ka.data());
                    x->read_k(l, cx, kx.data());
                    a.read_v(l, ca, va.data());
                    x->read_v(l, cx, vx.data());
                    REQUIRE(kx == ka);
                    REQUIRE(vx == va);
                }
            }
        CHECK(io::save_seq(b, 0) == saved);
        CHECK(io::save_seq(c, 0) == saved);
    }
}
