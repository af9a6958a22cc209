// The state-loader fuzz harness, shared by the libFuzzer target (clang) and by
// test_fuzz_replay (any compiler), which runs the seed corpus and every regression
// input through it as an ordinary test.
//
// Each input is loaded into one of several caches (layouts, element types; see
// targets), twice: as given, and "resealed" (total_size and the checksum rewritten to
// match), so that mutations reach the structural checks behind the checksum. After
// every load:
//   - refused: the cache must save to exactly the bytes it saved before the load (for
//     a ring: its pruning points too, which its baseline has);
//   - accepted: saving and loading that into a second cache must succeed and give the
//     same cells (the same bytes where the cache numbers cells itself: contiguous) and,
//     for a ring, the same pruning points;
//   - paged and ring: the layout's tables must still match the cells.
// Any violation prints what happened and aborts (a libFuzzer crash).
#pragma once

#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#if __has_include(<kvcache/layout/paged.hpp>) && __has_include(<kvcache/layout/ring.hpp>)
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>
#define KVFUZZ_HAS_PAGED_RING 1
#endif

namespace kvfuzz {

namespace io = kvcache::io;

/// Shape A (f16; contiguous, paged<32>, ring<8>) and shape B (f32, transposed V, odd sizes).
inline kvcache::model_shape shape_a() {
    kvcache::model_shape s;
    s.n_layer = 2;
    s.n_head_kv = 2;
    s.head_dim_k = 8;
    s.n_cells = 128;  // ring<8>: regions of 32
    s.n_seq_max = 4;
    return s;
}
/// Shape A for paged<32>: 8 blocks (the baseline's sequences take 5, one for the shared cell).
inline kvcache::model_shape shape_a_paged() {
    kvcache::model_shape s = shape_a();
    s.n_cells = 256;
    return s;
}
inline kvcache::model_shape shape_b() {
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 4;
    s.head_dim_v = 6;
    s.n_cells = 20;
    s.n_seq_max = 2;
    return s;
}

/// Shape Q for the quantized targets (q8_0 contiguous, q4_0 transposed V): head rows of
/// one and two blocks of 32 values.
inline kvcache::model_shape shape_q() {
    kvcache::model_shape s;
    s.n_layer = 2;
    s.n_head_kv = 2;
    s.head_dim_k = 64;
    s.head_dim_v = 32;
    s.n_cells = 48;
    s.n_seq_max = 4;
    return s;
}

[[noreturn]] inline void die(const char* layout, const char* what, const std::string& msg) {
    std::fprintf(stderr, "kvfuzz: %s: %s (%s)\n", layout, what, msg.c_str());
    std::abort();
}

/// A few positions of a few sequences, some shared, written with fixed K/V values.
template <class Cache>
void fill_baseline(Cache& c) {
    const auto& sh = c.shape();
    const auto n_seq = static_cast<kvcache::seq_id_t>(sh.n_seq_max);
    std::vector<float> k(sh.k_row_size()), v(sh.v_row_size());
    for (kvcache::seq_id_t s = 0; s < n_seq; ++s) {
        for (kvcache::pos_t p = 0; p < 3 + s; ++p) {
            const kvcache::pos_t pos[1] = {p};
            const kvcache::seq_id_t seq[1] = {s};
            auto r = c.place(pos, seq);
            if (!r) die(Cache::layout::name.data(), "baseline placement failed", r.message());
            for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
                for (std::size_t i = 0; i < k.size(); ++i) k[i] = 0.125f * static_cast<float>((i + l + p) % 17) - 1.0f;
                for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * static_cast<float>((i * 3 + s) % 11) - 1.0f;
                c.write_k(l, r.value().cells, k.data());
                c.write_v(l, r.value().cells, v.data());
            }
            static_cast<void>(c.commit());
        }
    }
    if (n_seq > 1) {  // one cell shared by the first and the last sequence
        kvcache::seq_set both = kvcache::seq_set::of(0);
        both.set(n_seq - 1);
        const kvcache::pos_t pos[1] = {n_seq + 2};
        const kvcache::seq_set seqs[1] = {both};
        auto r = c.place(std::span<const kvcache::pos_t>(pos), std::span<const kvcache::seq_set>(seqs));
        if (!r) die(Cache::layout::name.data(), "baseline placement failed", r.message());
        for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
            c.write_k(l, r.value().cells, k.data());
            c.write_v(l, r.value().cells, v.data());
        }
        static_cast<void>(c.commit());
    }
}

/// Ring caches: sequence 0 also generates past the window, so the baseline has a
/// pruning point (positions below 12 of sequence 0 are gone).
template <class Cache>
void prune_baseline(Cache& c) {
    if constexpr (requires { c.storage().pruned_below(0); }) {
        std::vector<float> k(c.shape().k_row_size(), 0.25f), v(c.shape().v_row_size(), -0.5f);
        for (kvcache::pos_t p = c.seq_pos_max(0) + 1; p < 20; ++p) {
            const kvcache::pos_t pos[1] = {p};
            const kvcache::seq_id_t seq[1] = {0};
            auto r = c.place(pos, seq);
            if (!r) die(Cache::layout::name.data(), "baseline placement failed", r.message());
            for (std::uint32_t l = 0; l < c.shape().n_layer; ++l) {
                c.write_k(l, r.value().cells, k.data());
                c.write_v(l, r.value().cells, v.data());
            }
            static_cast<void>(c.commit());
        }
        if (c.storage().pruned_below(0) == 0) die(Cache::layout::name.data(), "baseline", "nothing pruned");
    }
}

/// Pruning points of every sequence (ring caches; empty for the others).
template <class Cache>
std::vector<kvcache::pos_t> pruning_points(const Cache& c) {
    std::vector<kvcache::pos_t> out;
    if constexpr (requires { c.storage().pruned_below(0); })
        for (kvcache::seq_id_t s = 0; s < static_cast<kvcache::seq_id_t>(c.shape().n_seq_max); ++s)
            out.push_back(c.storage().pruned_below(s));
    return out;
}

/// Every used cell as bytes (position, pending shift, sequences, raw K/V of every
/// layer), sorted: equal for two caches exactly when they hold the same cells.
template <class Cache>
std::vector<std::string> canonical(const Cache& c) {
    std::vector<std::string> out;  // strings: GCC 12 warns falsely when sorting vectors of bytes
    std::vector<typename Cache::storage_type> row;
    for (std::uint32_t cell : c.cells().used_cells()) {
        std::string b;
        auto put = [&](const void* p, std::size_t n) { b.append(static_cast<const char*>(p), n); };
        const kvcache::pos_t pos = c.cells().pos(cell);
        const std::int32_t shift = c.cells().shift(cell);
        put(&pos, sizeof(pos));
        put(&shift, sizeof(shift));
        c.cells().seqs(cell).for_each([&](kvcache::seq_id_t s) { put(&s, sizeof(s)); });
        for (std::uint32_t l = 0; l < c.shape().n_layer; ++l)
            for (bool is_v : {false, true}) {
                c.storage().cell_bytes(l, cell, is_v, row);
                put(row.data(), row.size() * sizeof(row[0]));
            }
        out.push_back(std::move(b));
    }
    std::sort(out.begin(), out.end());
    return out;
}

/// One cache under test, its scratch twin and the bytes of its baseline state.
template <class Cache>
struct target {
    std::unique_ptr<Cache> cache, twin;
    std::vector<std::byte> baseline;  // the state every run starts from
    std::vector<std::byte> current;   // the cache's bytes now (baseline, cells possibly renumbered)

    explicit target(const kvcache::model_shape& s)
        : cache(std::make_unique<Cache>(s)), twin(std::make_unique<Cache>(s)) {
        fill_baseline(*cache);
        prune_baseline(*cache);
        baseline = io::save_state(*cache);
        current = baseline;
    }

    void check_tables(const char* when) const {
        if constexpr (requires { cache->storage().check_invariants(cache->cells()); }) {
            const std::string bad = cache->storage().check_invariants(cache->cells());
            if (!bad.empty()) die(Cache::layout::name.data(), when, bad);
        }
    }

    /// Loads `in` as a whole cache or (one_seq) as one sequence into sequence 1.
    void run(std::span<const std::byte> in, bool one_seq) {
        const char* name = Cache::layout::name.data();
        auto r = one_seq ? io::load_seq(*cache, 1, in) : io::load_state(*cache, in);
        check_tables("block tables after a load");
        if (!r) {
            scratch.resize(io::state_size(*cache));
            io::save_state_into(*cache, std::span<std::byte>(scratch));
            if (scratch != current) die(name, "refused load changed the cache", r.message());
            return;
        }
        const auto saved = io::save_state(*cache);
        auto again = io::load_state(*twin, saved);
        if (!again) die(name, "a state saved after a load does not load", again.message());
        if constexpr (requires { cache->storage().plan_place(cache->cells(), std::span<const kvcache::pos_t>(),
                                                              std::span<const kvcache::seq_set>()); }) {
            // The layout numbers the cells itself, so the cell order (and so the bytes) may
            // differ; the cells must not.
            if (canonical(*twin) != canonical(*cache)) die(name, "save -> load changed the cells", "");
            if (pruning_points(*twin) != pruning_points(*cache)) die(name, "save -> load changed pruning points", "");
        } else if (io::save_state(*twin) != saved) {
            die(name, "save -> load -> save differs", "");
        }
        auto back = io::load_state(*cache, baseline);  // the next input starts from the baseline again
        if (!back) die(name, "baseline does not load", back.message());
        current = io::save_state(*cache);  // a layout that numbers cells itself may order them anew
    }

    std::vector<std::byte> scratch;  // the cache's state after a refused load
};

/// The caches under test. Each input goes to one of them, picked from fields the
/// fuzzer mutates (element size: shape B when 4, the q8_0 / q4_0 targets when its low 16
/// bits are 34 / 18; layout_id: contiguous, paged or ring)
/// and loaded with load_seq when its kind says one sequence, else with load_state:
/// two loads per input (as given, resealed) instead of every combination keeps
/// executions fast, and the mutations still reach every target and both loaders.
struct targets {
    target<kvcache::kv_cache<kvcache::f16>> a{shape_a()};
    target<kvcache::kv_cache<kvcache::f32, kvcache::contiguous<kvcache::v_layout::transposed>>> b{shape_b()};
    // Quantized blocks (bad scales, NaN scales, blocks cut short: io/format.hpp).
    target<kvcache::kv_cache<kvcache::q8_0>> q8{shape_q()};
    target<kvcache::kv_cache<kvcache::q4_0, kvcache::contiguous<kvcache::v_layout::transposed>>> q4{shape_q()};
#ifdef KVFUZZ_HAS_PAGED_RING
    target<kvcache::kv_cache<kvcache::f16, kvcache::paged<32>>> a_paged{shape_a_paged()};
    target<kvcache::kv_cache<kvcache::f16, kvcache::ring<8>>> a_ring{shape_a()};
#endif
    void run(std::span<const std::byte> in) {
        auto field = [&](std::size_t at) -> std::uint32_t {
            return in.size() >= at + 4 ? io::detail::load_le<std::uint32_t>(in.data() + at) : 0u;
        };
        namespace off = io::detail::off;
        const bool one_seq = field(off::kind) == 1;
        if (field(off::elem_size) == 4) return b.run(in, one_seq);
        if ((field(off::elem_size) & 0xffffu) == sizeof(kvcache::block_q8_0)) return q8.run(in, one_seq);
        if ((field(off::elem_size) & 0xffffu) == sizeof(kvcache::block_q4_0)) return q4.run(in, one_seq);
#ifdef KVFUZZ_HAS_PAGED_RING
        switch (field(off::layout_id) / 2 % 3) {  // ids 0/1 contiguous, 2/3 paged, 4/5 ring
            case 1: return a_paged.run(in, one_seq);
            case 2: return a_ring.run(in, one_seq);
            default: break;
        }
#endif
        a.run(in, one_seq);
    }
};

/// Runs one input (as given and resealed) through every target.
inline int run_one(const std::uint8_t* data, std::size_t size) {
    static targets t;  // built once: every run leaves each cache at its baseline
    const auto* p = reinterpret_cast<const std::byte*>(data);
    t.run(std::span<const std::byte>(p, size));
    if (size >= io::state_header_size + io::state_checksum_size) {
        std::vector<std::byte> fixed(p, p + size);
        const std::uint64_t total = size;
        std::memcpy(fixed.data() + io::detail::off::total_size, &total, 8);
        const std::uint64_t h = io::checksum(std::span<const std::byte>(fixed.data(), size - 8));
        std::memcpy(fixed.data() + size - 8, &h, 8);
        t.run(fixed);
    }
    return 0;
}

}  // namespace kvfuzz
