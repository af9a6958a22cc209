// Fault injection: every mutating operation of every memory, with an operator new that
// throws std::bad_alloc at the N-th allocation after arming, for N = 1, 2, ... until the
// operation completes. After each throw the memory must be bit-identical to a snapshot
// taken before (cell metadata, indexes, K/V bytes of occupied cells, block tables,
// refcounts, free blocks, ring pruning points, transaction state) and must place the
// next batch exactly like an untouched twin (slot-search head, paged open-block hints);
// after the completing run it must equal the same operation on an untouched twin.
#include <doctest/doctest.h>

#include <kvcache/element/q8_0.hpp>
#include <kvcache/io/hybrid.hpp>
#include <kvcache/io/recurrent.hpp>
#include <kvcache/io/state.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>
#include <kvcache/memory/hybrid.hpp>
#include <kvcache/memory/iswa_cache.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/ops/context_shift.hpp>
#include <kvcache/ops/defrag.hpp>
#include <kvcache/ops/hybrid.hpp>
#include <kvcache/ops/kshift.hpp>
#include <kvcache/reuse/plan.hpp>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/fault_alloc.hpp"  // the counting operator new (this file is its only user here)
#include "support/memory_snapshot.hpp"

namespace fi = kvtest::fi;

using namespace kvcache;

namespace {

constexpr std::uint32_t W = 16;
using contig_t = kv_cache<f32>;
using contig_q8_t = kv_cache<q8_0>;  // quantized K/V: blocks of 32 values of one cell
template <class M>
constexpr bool fi_contiguous = std::is_same_v<M, contig_t> || std::is_same_v<M, contig_q8_t>;
using paged_t = kv_cache<f32, paged<32>>;
using ring_t = kv_cache<f32, ring<W>>;
using iswa_t = iswa_cache<W, f32>;

model_shape small_shape(std::uint32_t n_cells, std::uint32_t n_seq) {
    model_shape s;
    s.n_layer = 2;
    s.n_head_kv = 2;
    s.head_dim_k = 8;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq;
    return s;
}

using kvtest::snap;
using kvtest::first_diff;
using kvtest::snapshot;

// ------------------------------------------------------------ fixtures
/// Writes deterministic K/V rows for placed cells.
/// Plain check usable while allocations are armed (doctest's macros allocate).
void must(bool ok) {
    if (!ok) throw std::logic_error("fault injection fixture: unexpected refusal");
}

template <class M, class P>
void write_rows(M& m, const P& placed, std::size_t n, float seed) {
    const model_shape& sh = [&]() -> const model_shape& {
        if constexpr (requires { m.full(); }) return m.full().shape();
        else return m.shape();
    }();
    const std::uint32_t n_layer = [&] {
        if constexpr (requires { m.n_layer(); }) return m.n_layer();
        else return sh.n_layer;
    }();
    std::vector<float> k(n * sh.k_row_size()), v(n * sh.v_row_size());
    for (std::uint32_t l = 0; l < n_layer; ++l) {
        for (std::size_t i = 0; i < k.size(); ++i) k[i] = seed + 0.001f * static_cast<float>(i) + static_cast<float>(l);
        for (std::size_t i = 0; i < v.size(); ++i) v[i] = -seed - 0.002f * static_cast<float>(i) - static_cast<float>(l);
        if constexpr (requires { m.full(); }) {
            m.write_k(l, placed, k.data());
            m.write_v(l, placed, v.data());
        } else {
            m.write_k(l, placed.cells, k.data());
            m.write_v(l, placed.cells, v.data());
        }
    }
}
template <class M>
void put(M& m, seq_id_t s, pos_t p0, std::uint32_t n, float seed) {
    std::vector<pos_t> pos(n);
    std::vector<seq_id_t> seq(n, s);
    for (std::uint32_t i = 0; i < n; ++i) pos[i] = p0 + static_cast<pos_t>(i);
    auto r = m.place(pos, seq);
    must(r.ok());
    write_rows(m, r.value(), n, seed);
    must(m.commit() == tx_result::committed);
}

/// Sequence 0: 0..11; seq 1 shares 0..6 of it (seq_cp) and has 7..9 of its own;
/// seq 2: 0..5. `tight`: fill the cache so that no block / almost no cell is free.
template <class M>
M make_cache(bool tight) {
    M m = [] {
        if constexpr (std::is_same_v<M, contig_q8_t>) {
            model_shape q = small_shape(128, 4);
            q.head_dim_k = 32;  // one q8_0 block per head row
            return M(q);
        } else if constexpr (std::is_same_v<M, contig_t> || std::is_same_v<M, paged_t>) return M(small_shape(128, 4));
        else if constexpr (std::is_same_v<M, ring_t>) return M(small_shape(ring<W>::cells_for(4, 8), 4));
        else {
            iswa_shape s;
            s.shape = small_shape(128, 4);
            s.shape.n_layer = 3;
            s.swa_layers = iswa_shape::every_nth_full(3, 3);
            s.swa_n_cells = ring<W>::cells_for(4, 8);
            return M(s);
        }
    }();
    put(m, 0, 0, 12, 1.0f);
    must(m.seq_cp(0, 1, 0, 7).ok());
    put(m, 1, 7, 3, 2.0f);
    put(m, 2, 0, 6, 3.0f);
    if (tight) {
        if constexpr (std::is_same_v<M, paged_t>) put(m, 3, 0, 32, 4.0f);  // the last free block
        else if constexpr (fi_contiguous<M>) put(m, 3, 0, 105, 4.0f);  // 2 cells left
    }
    return m;
}

/// The next placement after an operation: the same cells on the cache and its twin.
template <class M>
std::string next_place(M& m) {
    std::vector<pos_t> pos{m.seq_pos_max(2) + 1, m.seq_pos_max(2) + 2};
    std::vector<seq_id_t> seq{2, 2};
    auto r = m.place(pos, seq);
    std::ostringstream os;
    if (!r) {
        os << "refused " << r.message();
        return os.str();
    }
    if constexpr (requires { r.value().full; }) {
        for (std::uint32_t c : r.value().full.cells) os << c << ' ';
        os << "| ";
        for (std::uint32_t c : r.value().swa.cells) os << c << ' ';
    } else {
        for (std::uint32_t c : r.value().cells) os << c << ' ';
    }
    m.restore();
    return os.str();
}

template <class R>
std::string describe(const R& r) {
    std::ostringstream os;
    if (r.ok())
        os << "ok";
    else
        os << "error " << static_cast<int>(r.code());
    return os.str();
}

/// Sweeps N = 1, 2, ... for operation `op` on a cache built by make_cache(tight).
long total_throws = 0;
long total_absorbed = 0;  // failures a fallback absorbed (the call completed as unarmed)

/// `prep` runs unarmed before the snapshot. What each run n is compared with comes from
/// two untouched twins built once per sweep (caches built alike are alike: make_cache is
/// deterministic, and run 1 checks it): `fresh` as the call found it, `done` after the call
/// ran unarmed. A twin built per n took half the sweep's time (most of it allocation under
/// ASan).
template <class M>
void sweep(const std::string& name, bool tight, const std::function<std::string(M&)>& op,
           const std::function<void(M&)>& prep) {
    CAPTURE(name);
    M fresh = make_cache<M>(tight), done = make_cache<M>(tight);
    if (prep) {
        prep(fresh);
        prep(done);
    }
    const snap before = snapshot(fresh);
    const std::string before_next = next_place(fresh);
    const snap before_after_next = snapshot(fresh);
    const std::string want = op(done);
    const snap want_after = snapshot(done);
    const std::string want_next = next_place(done);
    int throws = 0;
    for (long n = 1;; n = fi::next_n(n)) {
        CAPTURE(n);
        M m = make_cache<M>(tight);
        if (prep) prep(m);
        if (n == 1) REQUIRE(snapshot(m) == before);  // built alike
        std::string got;
        bool threw = false;
        fi::arm(n);
        try {
            got = op(m);
        } catch (const std::bad_alloc&) {
            threw = true;
        } catch (...) {
            fi::disarm();  // doctest reports it, and allocates to do so
            throw;
        }
        const bool fired = fi::disarm_fired();
        if (threw) {
            ++throws;
            const snap after = snapshot(m);
            INFO(first_diff(before, after));
            REQUIRE(after == before);
            REQUIRE(next_place(m) == before_next);
            REQUIRE(snapshot(m) == before_after_next);
            continue;
        }
        CHECK(got == want);
        const snap a = snapshot(m);
        INFO(first_diff(a, want_after));
        REQUIRE(a == want_after);
        REQUIRE(next_place(m) == want_next);
        if (fired) {  // absorbed by a fallback (fi::disarm_fired): the points after it remain
            ++total_absorbed;
            continue;
        }
        total_throws += throws;
        break;
    }
}

template <class M>
void sweep_all() {
    using ops_t = std::vector<std::pair<const char*, std::function<std::string(M&)>>>;
    ops_t ops = {
        {"place 3 tokens", [](M& m) {
             std::vector<pos_t> pos{12, 13, 14};
             std::vector<seq_id_t> seq{0, 0, 0};
             return describe(m.place(pos, seq));
         }},
        {"place (copy-on-write of a shared last block on paged)", [](M& m) {
             std::vector<pos_t> pos{10};
             std::vector<seq_id_t> seq{1};
             return describe(m.place(pos, seq));
         }},
        {"place two sequences", [](M& m) {
             std::vector<pos_t> pos{6, 10, 7};
             std::vector<seq_id_t> seq{2, 1, 2};
             return describe(m.place(pos, seq));
         }},
        {"place + restore", [](M& m) {
             std::vector<pos_t> pos{10, 11};
             std::vector<seq_id_t> seq{1, 1};
             auto r = m.place(pos, seq);
             if (r) return std::to_string(static_cast<int>(m.restore()));
             return describe(r);
         }},
        {"place + commit", [](M& m) {
             std::vector<pos_t> pos{12, 13, 14, 15, 16, 17, 18, 19};
             std::vector<seq_id_t> seq(8, 0);
             auto r = m.place(pos, seq);
             if (!r) return describe(r);
             try {
                 return std::to_string(static_cast<int>(m.commit()));
             } catch (const std::bad_alloc&) {
                 // A commit hook's documented failure (ring, ISWA): the transaction stays
                 // open with the cache as after place; a host restores it, as here.
                 REQUIRE(m.in_transaction());
                 static_cast<void>(m.restore());
                 throw;
             }
         }},
        {"seq_rm part", [](M& m) { return describe(m.seq_rm(0, 5, 12)); }},
        {"seq_rm all sequences", [](M& m) { return describe(m.seq_rm(-1, 3, -1)); }},
        {"seq_cp", [](M& m) { return describe(m.seq_cp(0, 2, 6, -1)); }},
        {"seq_keep", [](M& m) {
             m.seq_keep(1);
             return std::string("ok");
         }},
        {"clear", [](M& m) {
             m.clear();
             return std::string("ok");
         }},
    };
    if constexpr (M::can_shift) {
        ops.push_back({"seq_add with splits", [](M& m) { return describe(m.seq_add(0, 2, -1, 3)); }});
        ops.push_back({"seq_add all", [](M& m) { return describe(m.seq_add(-1, 4, -1, -2)); }});
        ops.push_back({"seq_div", [](M& m) { return describe(m.seq_div(0, 0, -1, 2)); }});
        ops.push_back({"context_shift", [](M& m) { return describe(ops::context_shift(m, 0, 4, 4)); }});
        ops.push_back({"self_extend", [](M& m) {
                           ops::self_extend_state st{2, 8, 0};
                           return describe(ops::self_extend(m, 0, st, 12));
                       }});
        ops.push_back({"apply_plan", [](M& m) {
                           reuse::plan p;
                           p.n_lcp = 4;
                           p.moves = {{8, 4, 4}};
                           p.n_past = 8;
                           p.n_request = 9;
                           return describe(reuse::apply_plan(m, 0, p));
                       }});
        ops.push_back({"apply_k_shift", [](M& m) {
                           ops::apply_k_shift(m, 1);
                           return std::string("ok");
                       }});
    }
    ops.push_back({"load_state (whole)", [](M& m) {
                       M other = make_cache<M>(false);
                       must(other.seq_rm(0, 10, -1).ok());
                       const auto bytes = io::save_state(other);
                       return describe(io::load_state(m, bytes));
                   }});
    ops.push_back({"load_seq", [](M& m) {
                       M other = make_cache<M>(false);
                       const auto bytes = io::save_seq(other, 0);
                       return describe(io::load_seq(m, 3, bytes));  // (prep emptied sequence 3)
                   }});
    if constexpr (fi_contiguous<M>)
        ops.push_back({"defrag", [](M& m) {
                           ops::defrag_params p;
                           p.threshold = 0.0f;
                           p.min_cells = 0;
                           return std::to_string(ops::defrag(m, p).moves);
                       }});
    total_throws = 0;
    total_absorbed = 0;
    for (bool tight : {false, true})
        for (auto& [name, op] : ops) {
            CAPTURE(tight);
            std::function<void(M&)> prep;
            if (std::string(name) == "apply_k_shift") prep = [](M& m) { must(m.seq_add(2, 0, -1, 5).ok()); };
            if (std::string(name) == "defrag") prep = [](M& m) { must(m.seq_rm(0, 2, 8).ok()); };
            if (std::string(name) == "load_seq") prep = [](M& m) { must(m.seq_rm(3, -1, -1).ok()); };
            sweep<M>(name, tight, op, prep);
        }
    CHECK(total_throws > static_cast<long>(ops.size()));  // every operation allocates, so most sweeps throw
    std::printf("  %ld injected allocation failures survived (and %ld absorbed by a fallback)\n", total_throws,
                total_absorbed);
}

// ---------------------------------------------- recurrent_memory and hybrid_memory
// The same sweep for the state memories: the snapshot is the recurrent part's
// intervals and state bytes (and, for a hybrid memory, the attention part's snapshot);
// an operation that reports a refusal or throws kvcache::error must also leave the
// memory as it was before, once it completes.

using rec_t = recurrent_memory;
using hyb_t = hybrid_memory<paged_t>;

recurrent_shape rec_fi_shape() {
    recurrent_shape s;
    s.n_layer = 2;
    s.n_seq_max = 4;
    s.d_conv = 3;
    s.d_inner = 4;
    s.ssm_size = 6;
    return s;
}
const std::vector<bool> rec_fi_layers{false, true, false, true};  // attention, recurrent, attention, recurrent

const recurrent_memory& rec_part(const rec_t& m) { return m; }
const recurrent_memory& rec_part(const hyb_t& m) { return m.recurrent(); }

void rec_snapshot_into(const recurrent_memory& r, snap& out) {
    {
        std::ostringstream os;
        os << "rec tx " << r.in_transaction() << " bytes " << r.total_bytes();
        out.lines.push_back(os.str());
    }
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(r.n_seq_max()); ++s) {
        std::ostringstream os;
        os << "rec seq " << s << " [" << r.seq_pos_min(s) << ", " << r.seq_pos_max(s) << "]";
        for (float x : r.seq_state(s)) os << ' ' << x;  // exact decimal of small test values
        out.lines.push_back(os.str());
    }
}
template <class M>
snap rec_snapshot(const M& m) {
    snap out;
    if constexpr (std::is_same_v<M, hyb_t>) {
        out = snapshot(m.attention());
        std::ostringstream os;
        os << "hybrid tx " << m.in_transaction() << " shift " << m.has_shift();
        out.lines.push_back(os.str());
    }
    rec_snapshot_into(rec_part(m), out);
    return out;
}

/// Row buffers of one batch, allocated before a placement (so that an operation's only
/// allocations before its commit/restore are the library's own).
struct rec_rows {
    std::vector<float> k, v;
};
template <class M>
rec_rows rec_rows_for(const M& m, std::size_t n) {
    rec_rows r;
    if constexpr (std::is_same_v<M, hyb_t>) {
        r.k.resize(n * m.attention().shape().k_row_size());
        r.v.resize(n * m.attention().shape().v_row_size());
    }
    return r;
}
/// Writes the batch's recurrent states (and K/V rows of a hybrid memory's attention
/// layers) with values derived from seed; allocates nothing.
template <class M, class P>
void rec_write(M& m, const P& p, rec_rows& rows, float seed) {
    auto step = [seed](std::span<float> st, std::uint32_t l) {
        for (std::size_t i = 0; i < st.size(); ++i)
            st[i] = st[i] * 0.5f + seed + 0.25f * static_cast<float>(i % 7) + static_cast<float>(l);
    };
    if constexpr (std::is_same_v<M, hyb_t>) {
        for (std::uint32_t l = 0; l < m.n_layer(); ++l) {
            if (m.is_recurrent(l)) {
                for (seq_id_t s : p.recurrent.seqs) {
                    step(m.conv_state(l, s), l);
                    step(m.ssm_state(l, s), l);
                }
                continue;
            }
            for (std::size_t i = 0; i < rows.k.size(); ++i) rows.k[i] = seed + 0.125f * static_cast<float>(i % 9 + l);
            for (std::size_t i = 0; i < rows.v.size(); ++i) rows.v[i] = -seed - 0.25f * static_cast<float>(i % 5 + l);
            m.write_k(l, p, rows.k.data());
            m.write_v(l, p, rows.v.data());
        }
    } else {
        for (std::uint32_t l = 0; l < m.n_layer(); ++l)
            for (seq_id_t s : p.seqs) {
                step(m.conv_state(l, s), l);
                step(m.ssm_state(l, s), l);
            }
    }
}
template <class M>
void rec_put(M& m, seq_id_t s, pos_t p0, std::uint32_t n, float seed) {
    std::vector<pos_t> pos(n);
    std::vector<seq_id_t> seq(n, s);
    for (std::uint32_t i = 0; i < n; ++i) pos[i] = p0 + static_cast<pos_t>(i);
    rec_rows rows = rec_rows_for(m, n);
    auto r = m.place(pos, seq);
    must(r.ok());
    rec_write(m, r.value(), rows, seed);
    must(m.commit() == tx_result::committed);
}

/// Sequence 0: 0..11; sequence 1: a copy of sequence 0 (seq_cp of its whole interval)
/// continued with 12..14; sequence 2: 0..5; sequence 3 empty. `tight` (hybrid): the
/// paged attention part's last free block taken by sequence 3.
template <class M>
M rec_make(bool tight) {
    M m = [] {
        if constexpr (std::is_same_v<M, hyb_t>) return M(small_shape(128, 4), rec_fi_shape(), rec_fi_layers);
        else return M(rec_fi_shape());
    }();
    rec_put(m, 0, 0, 12, 1.0f);
    must(m.seq_cp(0, 1, -1, -1).ok());
    rec_put(m, 1, 12, 3, 2.0f);
    rec_put(m, 2, 0, 6, 3.0f);
    if constexpr (std::is_same_v<M, hyb_t>)
        if (tight) rec_put(m, 3, 0, 32, 4.0f);
    return m;
}

/// The next batch after an operation (placed, written, restored): the same placement on
/// the memory and its twin, and the restore must put back what the batch wrote.
template <class M>
std::string rec_next_place(M& m) {
    if (m.in_transaction()) m.restore();
    const seq_id_t s = m.seq_pos_max(2) >= 0 || m.seq_pos_max(3) < 0 ? 2 : 3;
    const pos_t p = m.seq_pos_max(s) + 1;
    std::vector<pos_t> pos{p, p + 1};
    std::vector<seq_id_t> seq{s, s};
    rec_rows rows = rec_rows_for(m, 2);
    auto r = m.place(pos, seq);
    std::ostringstream os;
    if (!r) {
        os << "refused " << r.message();
        return os.str();
    }
    rec_write(m, r.value(), rows, 9.0f);
    if constexpr (std::is_same_v<M, hyb_t>) {
        for (std::uint32_t c : r.value().attention.cells) os << c << ' ';
        for (seq_id_t x : r.value().recurrent.slots) os << 's' << x << ' ';
    } else {
        for (seq_id_t x : r.value().slots) os << 's' << x << ' ';
    }
    m.restore();
    return os.str();
}

/// Catches kvcache::error (an invalid argument) as an outcome of the operation (the
/// sweep does it for every operation: thrown errors are outcomes compared with the twin).
template <class F>
std::string rec_or_thrown(F&& f) {
    try {
        return f();
    } catch (const kvcache::error& e) {
        return "thrown " + std::to_string(static_cast<int>(e.code()));
    }
}

/// As sweep: the twins `fresh` (as the call found it) and `done` (after the call, unarmed)
/// are built once per sweep.
template <class M>
void rec_sweep(const std::string& name, bool tight, const std::function<std::string(M&)>& op,
               const std::function<void(M&)>& prep) {
    CAPTURE(name);
    CAPTURE(tight);
    M fresh = rec_make<M>(tight), done = rec_make<M>(tight);
    if (prep) {  // unarmed
        prep(fresh);
        prep(done);
    }
    const snap before = rec_snapshot(fresh);
    const std::string before_next = rec_next_place(fresh);
    const snap before_after_next = rec_snapshot(fresh);
    const std::string want = rec_or_thrown([&] { return op(done); });
    const snap want_after = rec_snapshot(done);
    const std::string want_next = rec_next_place(done);
    const snap want_after_next = rec_snapshot(done);
    int throws = 0;
    for (long n = 1;; n = fi::next_n(n)) {
        CAPTURE(n);
        M m = rec_make<M>(tight);
        if (prep) prep(m);
        if (n == 1) REQUIRE(rec_snapshot(m) == before);  // built alike
        std::string got;
        bool threw = false;
        fi::arm(n);
        try {
            got = rec_or_thrown([&] { return op(m); });
        } catch (const std::bad_alloc&) {
            threw = true;
        } catch (...) {
            fi::disarm();
            throw;
        }
        const bool fired = fi::disarm_fired();
        if (threw) {
            ++throws;
            const snap after = rec_snapshot(m);
            INFO(first_diff(before, after));
            REQUIRE(after == before);
            REQUIRE(rec_next_place(m) == before_next);
            const snap a = rec_snapshot(m);
            INFO(first_diff(a, before_after_next));
            REQUIRE(a == before_after_next);
            continue;
        }
        CHECK(got == want);
        // The outcome the name announces: "(refused ...)" an error result, "(thrown)" a kvcache::error.
        const bool refused_here = name.find("(refused") != std::string::npos &&
                                  (tight || name.find("when tight") == std::string::npos);
        CHECK((got.rfind("error", 0) == 0) == refused_here);
        CHECK((got.rfind("thrown", 0) == 0) == (name.find("(thrown)") != std::string::npos));
        const snap a = rec_snapshot(m);
        INFO(first_diff(a, want_after));
        REQUIRE(a == want_after);
        if (got.rfind("error", 0) == 0 || got.rfind("thrown", 0) == 0) {  // refused: nothing changed
            INFO(got);
            INFO(first_diff(before, a));
            REQUIRE(a == before);
        }
        REQUIRE(rec_next_place(m) == want_next);
        const snap a2 = rec_snapshot(m);
        INFO(first_diff(a2, want_after_next));
        REQUIRE(a2 == want_after_next);
        if (fired) {  // absorbed by a fallback (fi::disarm_fired): the points after it remain
            ++total_absorbed;
            continue;
        }
        total_throws += throws;
        break;
    }
}

template <class M>
void rec_sweep_all() {
    constexpr bool hybrid = std::is_same_v<M, hyb_t>;
    using ops_t = std::vector<std::pair<const char*, std::function<std::string(M&)>>>;
    auto place_op = [](std::vector<pos_t> pos, std::vector<seq_id_t> seq, int then) {
        // then: 0 leave the transaction open, 1 write + commit, 2 write + restore
        return [pos, seq, then](M& m) {
            return rec_or_thrown([&] {
                rec_rows rows = rec_rows_for(m, pos.size());
                auto r = m.place(pos, seq);
                if (!r || then == 0) return describe(r);
                rec_write(m, r.value(), rows, 5.0f);
                return std::to_string(static_cast<int>(then == 1 ? m.commit() : m.restore()));
            });
        };
    };
    ops_t ops = {
        {"place 3 tokens", place_op({12, 13, 14}, {0, 0, 0}, 0)},
        {"place two sequences", place_op({6, 15, 7}, {2, 1, 2}, 0)},
        {"place a new sequence", place_op({0, 1}, {3, 3}, 0)},
        {"place + commit", place_op({12, 13, 14, 15, 16, 17, 18, 19}, {0, 0, 0, 0, 0, 0, 0, 0}, 1)},
        {"place + restore", place_op({15, 6, 16}, {1, 2, 1}, 2)},
        {"place refused: a position not after the last (thrown)", place_op({12, 5}, {0, 0}, 0)},
        {"place refused: a sequence out of range (thrown)", place_op({12, 0}, {0, 4}, 0)},
        {"seq_rm whole sequence", [](M& m) { return describe(m.seq_rm(0, -1, -1)); }},
        {"seq_rm every sequence", [](M& m) { return describe(m.seq_rm(-1, 0, -1)); }},
        {"seq_rm missing the interval", [](M& m) { return describe(m.seq_rm(2, 100, 200)); }},
        {"seq_rm part (refused by history)", [](M& m) { return describe(m.seq_rm(0, 5, 12)); }},
        {"seq_rm all sequences, part (refused by history)", [](M& m) { return describe(m.seq_rm(-1, 3, -1)); }},
        {"seq_cp whole", [](M& m) { return describe(m.seq_cp(0, 3, -1, -1)); }},
        {"seq_cp part (refused by history)", [](M& m) { return describe(m.seq_cp(0, 3, 6, -1)); }},
        {"seq_cp into a non-empty sequence (thrown)", [](M& m) { return describe(m.seq_cp(0, 2, -1, -1)); }},
        {"seq_keep", [](M& m) {
             m.seq_keep(1);
             return std::string("ok");
         }},
        {"clear", [](M& m) {
             m.clear();
             return std::string("ok");
         }},
        {"seq_add whole", [](M& m) { return describe(m.seq_add(0, -1, -1, 3)); }},
        {"seq_add below 0 (sequence cleared)", [](M& m) { return describe(m.seq_add(2, -1, -1, -10)); }},
        {"seq_add part (refused by history)", [](M& m) { return describe(m.seq_add(0, 2, -1, 3)); }},
        {"seq_add all, partly below 0 (refused)", [](M& m) { return describe(m.seq_add(-1, 0, -1, -2)); }},
        {"seq_div whole", [](M& m) { return describe(m.seq_div(1, -1, -1, 2)); }},
        {"seq_div part (refused by history)", [](M& m) { return describe(m.seq_div(0, 4, -1, 2)); }},
        {"save_state + load_state (whole)", [](M& m) {
             M other = rec_make<M>(false);
             must(other.seq_rm(0, -1, -1).ok());
             rec_put(other, 3, 0, 4, 6.0f);
             const auto bytes = io::save_state(other);
             return describe(io::load_state(m, bytes));
         }},
        {"save_seq + load_seq", [](M& m) {
             M other = rec_make<M>(false);
             const auto bytes = io::save_seq(other, 1);
             return describe(io::load_seq(m, 3, bytes));
         }},
        {"load_state (refused: token limit)", [](M& m) {
             const std::vector<token_t> tokens{1, 2, 3, 4, 5, 6};
             const auto bytes = io::save_state(m, tokens);
             io::load_options opt;
             opt.max_tokens = 3;
             return describe(io::load_state(m, bytes, opt));
         }},
        {"load_seq (refused: truncated)", [](M& m) {
             auto bytes = io::save_seq(m, 0);
             bytes.resize(bytes.size() - 12);
             return describe(io::load_seq(m, 3, bytes));
         }},
        {"save_state", [](M& m) { return std::to_string(io::save_state(m).size()); }},
        {"reuse::apply_plan keeping all of a sequence (slot prefix reuse)", [](M& m) {
             reuse::plan p;
             p.n_request = 40;
             p.n_past = p.n_lcp = static_cast<std::uint32_t>(m.seq_pos_max(0) + 1);
             return describe(reuse::apply_plan(m, 0, p));
         }},
        {"reuse::apply_plan cutting a sequence (refused by history)", [](M& m) {
             reuse::plan p;
             p.n_request = 40;
             p.n_past = p.n_lcp = 3;
             return describe(reuse::apply_plan(m, 0, p));
         }},
        {"reuse::apply_plan n_past 0 (recompute: sequence cleared)", [](M& m) {
             reuse::plan p;
             p.n_request = 40;
             return describe(reuse::apply_plan(m, 1, p));
         }},
        {"take_checkpoint", [](M& m) {
             const recurrent_checkpoint cp = rec_part(m).take_checkpoint(1);
             return std::to_string(cp.state.size()) + " " + std::to_string(cp.pos_max);
         }},
    };
    if constexpr (!hybrid) {
        ops.push_back({"take_checkpoint + restore_checkpoint", [](M& m) {
                           const recurrent_checkpoint cp = m.take_checkpoint(1);
                           m.restore_checkpoint(2, cp);
                           return std::string("ok");
                       }});
        ops.push_back({"restore_checkpoint of another size (thrown)", [](M& m) {
                           return rec_or_thrown([&] {
                               recurrent_checkpoint cp = m.take_checkpoint(1);
                               cp.state.pop_back();
                               m.restore_checkpoint(2, cp);
                               return std::string("ok");
                           });
                       }});
    } else {
        ops.push_back({"place 33 tokens (refused when tight: no room in the attention part)",
                       place_op(std::vector<pos_t>{6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,
                                                   23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38},
                                std::vector<seq_id_t>(33, 2), 0)});
        ops.push_back({"apply_k_shift", [](M& m) {
                           ops::apply_k_shift(m, 1);
                           return std::to_string(m.has_shift());
                       }});
    }
    total_throws = 0;
    total_absorbed = 0;
    for (bool tight : {false, true}) {
        if (!hybrid && tight) break;  // a recurrent memory never runs out of room
        for (auto& [name, op] : ops) {
            std::function<void(M&)> prep;
            const std::string nm = name;
            if constexpr (hybrid)
                if (nm == "apply_k_shift") prep = [](M& m) { must(m.seq_add(2, -1, -1, 4).ok()); };
            if (tight && ((nm.rfind("seq_cp", 0) == 0 && nm.find("non-empty") == std::string::npos) ||
                          nm == "place a new sequence"))
                prep = [](M& m) { must(m.seq_rm(3, -1, -1).ok()); };  // sequence 3 must be empty
            rec_sweep<M>(name, tight, op, prep);
        }
    }
    CHECK(total_throws > static_cast<long>(ops.size()));
    std::printf("  %ld injected allocation failures survived (and %ld absorbed by a fallback)\n", total_throws,
                total_absorbed);
}

}  // namespace

TEST_CASE("fault injection: contiguous kv_cache") { sweep_all<contig_t>(); }
TEST_CASE("fault injection: contiguous kv_cache, q8_0 K/V") { sweep_all<contig_q8_t>(); }
TEST_CASE("fault injection: paged kv_cache") { sweep_all<paged_t>(); }
TEST_CASE("fault injection: ring kv_cache") { sweep_all<ring_t>(); }
TEST_CASE("fault injection: iswa_cache") { sweep_all<iswa_t>(); }
TEST_CASE("fault injection: recurrent_memory") { rec_sweep_all<rec_t>(); }
TEST_CASE("fault injection: hybrid_memory (paged attention)") { rec_sweep_all<hyb_t>(); }
