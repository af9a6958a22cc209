// The API fuzz harness, shared by the libFuzzer target kvcache_fuzz_api (clang) and by
// test_fuzz_api_replay (any compiler), which runs tests/fuzz/api_corpus/ through it.
//
// An input is a program: its first byte picks the memory (kv_cache<f32> contiguous,
// paged<32>, ring<8>, iswa_cache<8, f32>), every following operation takes an opcode
// byte, a fault byte and argument bytes (a missing byte reads 0). Operations: placement
// of one or two micro-batches (positions that follow the batch position rule or break
// it, one or two sequences per token) then commit or restore, seq_rm, seq_cp, seq_keep,
// seq_add, seq_div, ops::apply_k_shift, ops::defrag (contiguous), ops::context_shift,
// an io::save_state -> load_state round trip, clear, and invalid calls.
//
// The reference is tests/reference/layout_model.hpp (what every sequence holds: position
// -> K/V rows and pending shift), one per part of the memory (the ring part pruned to its
// window after every commit). After every operation (the comparison reads every cell once
// into scratch rows and looks it up in the model, allocating nothing in steady state;
// kvtest::observe / kvtest::same only build the report of a difference):
//   - accepted: every part's sequences (positions, pending shifts, K/V rows of every
//     layer) equal the model's, seq_pos_min / seq_pos_max agree, paged and ring tables
//     match the cells, no transaction is left open;
//   - refused (error result or kvcache::error) or failed (std::bad_alloc): the memory is
//     bit-identical to a snapshot taken before (tests/support/memory_snapshot.hpp) and the
//     refusal is one the model allows (invalid calls must be refused with invalid_argument;
//     valid calls only for want of room or, on a ring, history it pruned).
// Fault injection: when a fault byte says so, the N-th allocation of the operation
// throws std::bad_alloc (tests/support/fault_alloc.hpp, which the including executable
// must include exactly once before this header).
// Any violation prints the step and aborts (a libFuzzer crash).
#pragma once

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "reference/layout_model.hpp"
#include "reference/rope_ref.hpp"
#include "support/memory_snapshot.hpp"

namespace kvapi {

using namespace kvcache;
using kvtest::layout_model;
using kvtest::model_seq;
using kvtest::model_token;

constexpr std::uint32_t W = 8;     // ring window
constexpr seq_id_t n_seq = 3;      // sequences of every memory
constexpr std::size_t max_ops = 64;

using contig_t = kv_cache<f32>;
using paged_t = kv_cache<f32, paged<32>>;
using ring_t = kv_cache<f32, ring<W>>;
using iswa_t = iswa_cache<W, f32>;

/// Counters over every input run (printed by the replay and by the fuzzer at exit).
struct stats_t {
    std::uint64_t ops = 0, accepted = 0, refused = 0, alloc_failures = 0;
    std::uint64_t paged_load_no_space = 0;  // the known paged load limitation (see op_state)
};
inline stats_t stats;

/// The input as a stream of bytes; past its end every byte is 0.
struct reader {
    const std::uint8_t* p;
    std::size_t n, i = 0;
    std::uint8_t byte() { return i < n ? p[i++] : 0; }
    int upto(int k) { return k <= 0 ? 0 : byte() % k; }  // [0, k)
    bool done() const { return i >= n; }
};

[[noreturn]] inline void die(const char* kind, std::size_t step, const std::string& op, const std::string& what) {
    std::fprintf(stderr, "kvfuzz_api: %s, step %zu (%s): %s\n", kind, step, op.c_str(), what.c_str());
    std::abort();
}

inline model_shape base_shape(std::uint32_t n_cells) {
    model_shape s;
    s.n_layer = 2;
    s.n_head_kv = 2;
    s.head_dim_k = 8;
    s.head_dim_v = 4;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq;
    return s;
}

template <class M>
M make_memory() {
    if constexpr (std::is_same_v<M, contig_t>) return M(base_shape(40));
    else if constexpr (std::is_same_v<M, paged_t>) return M(base_shape(128));  // 4 blocks
    else if constexpr (std::is_same_v<M, ring_t>) return M(base_shape(ring<W>::cells_for(n_seq, 8)));
    else {
        iswa_shape s;
        s.shape = base_shape(40);
        s.shape.n_layer = 3;
        s.swa_layers = iswa_shape::every_nth_full(3, 3);  // layers 0, 1 SWA; 2 full
        s.swa_n_cells = ring<W>::cells_for(n_seq, 8);
        return M(s);
    }
}

// ------------------------------------------------------------ parts of a memory
template <class M>
constexpr bool is_iswa = requires(const M& m) { m.swa(); };

/// Calls f(part index, part cache, ring window or 0) for every K/V cache of the memory.
template <class M, class F>
void for_parts(const M& m, F&& f) {
    if constexpr (is_iswa<M>) {
        f(0, m.full(), 0u);
        f(1, m.swa(), W);
    } else {
        f(0, m, std::is_same_v<M, ring_t> ? W : 0u);
    }
}
template <class M>
constexpr std::size_t n_parts = is_iswa<M> ? 2 : 1;

template <class M>
const model_shape& shape_of(const M& m) {
    if constexpr (is_iswa<M>) return m.full().shape();
    else return m.shape();
}
/// (part, layer inside the part) of model layer l.
template <class M>
std::pair<std::size_t, std::uint32_t> where(const M& m, std::uint32_t l) {
    if constexpr (is_iswa<M>) return {m.is_swa(l) ? 1u : 0u, m.local_layer(l)};
    else return {0u, l};
}

/// Allocation failure injection around one call. Returns the refusal, if any.
enum class outcome { done, refused_result, refused_error, alloc_failed };
struct call_result {
    outcome what = outcome::done;
    errc code = errc::invalid_argument;
};
template <class F>
call_result guarded(long arm_n, F&& f) {
    call_result out;
    if (arm_n > 0) kvtest::fi::arm(arm_n);
    try {
        std::optional<errc> r = f();
        if (r) out = {outcome::refused_result, *r};
    } catch (const std::bad_alloc&) {
        out.what = outcome::alloc_failed;
    } catch (const kvcache::error& e) {
        out = {outcome::refused_error, e.code()};
    }
    kvtest::fi::disarm();
    return out;
}
template <class R>
std::optional<errc> code_of(const R& r) {
    if (r.ok()) return std::nullopt;
    return r.code();
}

// ------------------------------------------------------------ the run
template <class M>
struct run {
    const char* kind;
    M mem = make_memory<M>();
    std::vector<layout_model> model = std::vector<layout_model>(n_parts<M>, layout_model(n_seq));
    std::vector<std::uint32_t> windows = std::vector<std::uint32_t>(n_parts<M>, 0);
    std::vector<std::uint32_t> part_layers = std::vector<std::uint32_t>(n_parts<M>, 0);
    std::uint32_t next_value = 1;  // K/V values: distinct per token
    std::size_t step = 0;
    std::string op;

    explicit run(const char* k) : kind(k) {
        for_parts(mem, [&](std::size_t p, const auto& c, std::uint32_t w) {
            windows[p] = w;
            part_layers[p] = c.shape().n_layer;
        });
    }

    [[noreturn]] void fail(const std::string& what) { die(kind, step, op, what); }

    // The full-history part (0) answers the model's sequence questions.
    const model_seq& seq(seq_id_t s) { return model[0].seqs[static_cast<std::size_t>(s)]; }
    pos_t model_max(seq_id_t s) { return seq(s).empty() ? -1 : seq(s).rbegin()->first; }
    pos_t model_min(seq_id_t s) { return seq(s).empty() ? -1 : seq(s).begin()->first; }

    /// Position, first K and first V value of every token of every sequence (failure reports).
    static std::string rows(const std::vector<model_seq>& seqs) {
        std::ostringstream os;  // not operator+ chains: GCC 12 reports a false -Wrestrict on those
        for (std::size_t s = 0; s < seqs.size(); ++s) {
            os << 's' << s << ':';
            for (const auto& [p, t] : seqs[s]) {
                os << ' ' << p << '=';
                if (t.k.empty() || t.k[0].empty() || t.v.empty() || t.v[0].empty()) os << '?';
                else os << t.k[0][0] << '/' << t.v[0][0];
            }
            os << ';';
        }
        return os.str();
    }
    /// Whether part cache c holds exactly what model m says (every sequence: the same
    /// multiset of position, pending shift and K/V rows of every layer). The per-step check:
    /// reads every cell once into scratch rows and looks it up in the model, allocating
    /// nothing once the scratch buffers have grown (kvtest::observe + kvtest::same, which
    /// copy every token into maps and sorted vectors, are the slow path for the report).
    template <class C>
    bool matches(const C& c, const layout_model& m) {
        const model_shape& sh = c.shape();
        const cell_table& cells = c.cells();
        const std::size_t kn = sh.k_row_size(), vn = sh.v_row_size();
        k_rows_.resize(std::size_t{sh.n_layer} * kn);
        v_rows_.resize(std::size_t{sh.n_layer} * vn);
        counts_.assign(m.seqs.size(), 0);
        taken_.clear();
        for (std::uint32_t cell : cells.used_cells()) {
            for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
                c.read_k(l, cell, k_rows_.data() + l * kn);
                c.read_v(l, cell, v_rows_.data() + l * vn);
            }
            const pos_t pos = cells.pos(cell);
            const std::int32_t shift = cells.shift(cell);
            bool ok = true;
            cells.seqs(cell).for_each([&](seq_id_t s) {
                if (!ok) return;
                const auto si = static_cast<std::size_t>(s);
                if (si >= m.seqs.size()) { ok = false; return; }
                ++counts_[si];
                const auto [lo, hi] = m.seqs[si].equal_range(pos);
                for (auto it = lo; it != hi; ++it) {
                    const model_token& t = it->second;
                    if (t.shift != shift || std::find(taken_.begin(), taken_.end(), &t) != taken_.end()) continue;
                    bool eq = t.k.size() == sh.n_layer && t.v.size() == sh.n_layer;
                    for (std::uint32_t l = 0; eq && l < sh.n_layer; ++l)
                        eq = t.k[l].size() == kn && t.v[l].size() == vn &&
                             std::equal(t.k[l].begin(), t.k[l].end(), k_rows_.begin() + l * kn) &&
                             std::equal(t.v[l].begin(), t.v[l].end(), v_rows_.begin() + l * vn);
                    if (eq) {
                        taken_.push_back(&t);
                        return;
                    }
                }
                ok = false;  // no unmatched model token at this position with these rows
            });
            if (!ok) return false;
        }
        for (std::size_t s = 0; s < m.seqs.size(); ++s)
            if (counts_[s] != m.seqs[s].size()) return false;
        return true;
    }
    std::vector<float> k_rows_, v_rows_;       // scratch of matches(): one cell, every layer
    std::vector<std::size_t> counts_;          // cells per sequence
    std::vector<const model_token*> taken_;    // model tokens matched so far

    void check_all() {
        for_parts(mem, [&](std::size_t p, const auto& c, std::uint32_t) {
            if (!matches(c, model[p])) {
                const auto seen = kvtest::observe(c);
                if (!kvtest::same(seen, model[p].seqs))
                    fail("part " + std::to_string(p) + " differs from the model (cache | model): " +
                         kvtest::diff(seen, model[p].seqs) + " first K/V values: " + rows(seen) + " | " +
                         rows(model[p].seqs));
                fail("part " + std::to_string(p) + ": the fast comparison disagrees with kvtest::same");
            }
            if constexpr (requires { c.storage().check_invariants(c.cells()); }) {
                const std::string bad = c.storage().check_invariants(c.cells());
                if (!bad.empty()) fail("tables: " + bad);
            }
            if (c.in_transaction()) fail("a transaction is open");
        });
        for (seq_id_t s = 0; s < n_seq; ++s) {
            if (mem.seq_pos_max(s) != model_max(s))
                fail("seq_pos_max(" + std::to_string(s) + ") = " + std::to_string(mem.seq_pos_max(s)) + ", model " +
                     std::to_string(model_max(s)));
            if (mem.seq_pos_min(s) != model_min(s))
                fail("seq_pos_min(" + std::to_string(s) + ") = " + std::to_string(mem.seq_pos_min(s)) + ", model " +
                     std::to_string(model_min(s)));
        }
    }

    /// Runs f armed with arm_n; a refusal or failure must leave the memory unchanged and be
    /// allowed (`allowed(call_result)`); returns whether the call completed. Armed calls are
    /// compared with a full snapshot (block tables, refcounts, indexes, K/V bytes); a refused
    /// unarmed call with the model (unchanged) and the layout's table invariants, which
    /// keeps executions fast.
    template <class F, class A>
    bool attempt(long arm_n, F&& f, A&& allowed) {
        std::optional<kvtest::snap> before;
        if (arm_n > 0) before = kvtest::snapshot(mem);
        const call_result r = guarded(arm_n, f);
        ++stats.ops;
        if (r.what == outcome::done) {
            ++stats.accepted;
            return true;
        }
        if (before) {
            const kvtest::snap after = kvtest::snapshot(mem);
            if (!(after == *before))
                fail(std::string(r.what == outcome::alloc_failed ? "std::bad_alloc" : "a refusal") +
                     " changed the memory: " + kvtest::first_diff(*before, after));
        }
        if (r.what == outcome::alloc_failed) {
            if (!before) fail("std::bad_alloc without an injected failure");
            ++stats.alloc_failures;
        } else {
            ++stats.refused;
            if (!allowed(r)) fail("refused with errc " + std::to_string(static_cast<int>(r.code)) + " (" +
                                  (r.what == outcome::refused_error ? "thrown" : "result") + ")");
        }
        return false;
    }

    // Which refusals a valid call may meet: room, and on a ring what it pruned.
    static constexpr bool has_ring = std::is_same_v<M, ring_t> || is_iswa<M>;
    static bool room_or_history(const call_result& r) {
        return r.what == outcome::refused_result &&
               (r.code == errc::no_space || r.code == errc::batch_too_large || (has_ring && r.code == errc::unsupported));
    }
    static bool history_only(const call_result& r) {
        return r.what == outcome::refused_result && has_ring && r.code == errc::unsupported;
    }
    static bool invalid(const call_result& r) { return r.what == outcome::refused_error && r.code == errc::invalid_argument; }

    // ------------------------------------------------------------ argument decoding
    seq_id_t any_seq(reader& in, bool allow_all) {
        const int k = in.upto(allow_all ? n_seq + 1 : n_seq);
        return k == n_seq ? -1 : static_cast<seq_id_t>(k);
    }
    void range(reader& in, pos_t& p0, pos_t& p1) {
        const std::uint8_t b = in.byte();
        p0 = (b & 1) ? -1 : static_cast<pos_t>((b >> 1) % 40);
        const std::uint8_t c = in.byte();
        p1 = (c & 1) ? -1 : std::max<pos_t>(p0, 0) + static_cast<pos_t>((c >> 1) % 24);
    }

    // ------------------------------------------------------------ placement
    struct ubatch {
        std::vector<pos_t> pos;
        std::vector<seq_set> seqs;
        bool valid = true;  // by the batch position rule and the argument rules
    };
    /// Decodes one micro-batch and judges it by the rules of kv_cache::place: no sequence
    /// gets a position it holds or a position twice, and a sequence that holds cells gets
    /// increasing positions after its last one (the batch position rule).
    ubatch decode_batch(reader& in) {
        ubatch b;
        const int n = 1 + in.upto(6);
        std::map<seq_id_t, pos_t> prev;  // the sequence's last position in batch order
        std::map<seq_id_t, std::vector<pos_t>> given;
        for (int i = 0; i < n; ++i) {
            const std::uint8_t sb = in.byte(), pb = in.byte();
            seq_set ss = seq_set::of(static_cast<seq_id_t>(sb % n_seq));
            if (sb & 0x40) ss.set(static_cast<seq_id_t>((sb >> 2) % n_seq));
            pos_t next = -1;  // the largest position any of the token's sequences has so far
            ss.for_each([&](seq_id_t s) {
                next = std::max(next, model_max(s));
                if (prev.count(s)) next = std::max(next, prev[s]);
            });
            pos_t p = 0;
            switch (pb >> 5) {
                case 5: p = next + 1 + (pb % 4); break;          // a gap
                case 6: p = static_cast<pos_t>(pb % 48); break;  // anywhere
                case 7: p = std::max<pos_t>(next, 0); break;     // a position again
                default: p = next + 1; break;                    // the next position
            }
            ss.for_each([&](seq_id_t s) {
                if (seq(s).count(p)) b.valid = false;
                for (pos_t q : given[s]) b.valid = b.valid && q != p;
                if (model_max(s) >= 0) {
                    const pos_t last = prev.count(s) ? prev[s] : model_max(s);
                    if (p <= last) b.valid = false;
                }
                prev[s] = p;
                given[s].push_back(p);
            });
            b.pos.push_back(p);
            b.seqs.push_back(ss);
        }
        return b;
    }
    /// Writes distinct K/V rows to the placed tokens and records them in the model.
    template <class P>
    void write_and_record(const P& placed, const ubatch& b) {
        const model_shape& sh = shape_of(mem);
        const std::size_t n = b.pos.size();
        std::vector<std::vector<model_token>> toks(n_parts<M>, std::vector<model_token>(n));
        for (std::size_t p = 0; p < n_parts<M>; ++p)
            for (auto& t : toks[p]) {
                t.k.resize(part_layers[p]);
                t.v.resize(part_layers[p]);
            }
        const std::uint32_t n_layer = [&] {
            if constexpr (is_iswa<M>) return mem.n_layer();
            else return sh.n_layer;
        }();
        for (std::uint32_t l = 0; l < n_layer; ++l) {
            std::vector<float> k(n * sh.k_row_size()), v(n * sh.v_row_size());
            for (std::size_t i = 0; i < k.size(); ++i)
                k[i] = static_cast<float>((next_value * 131 + i * 7 + l * 17) % 1021) / 256.0f - 2.0f;
            for (std::size_t i = 0; i < v.size(); ++i)
                v[i] = static_cast<float>((next_value * 97 + i * 11 + l * 5) % 1019) / 128.0f - 4.0f;
            mem.write_k(l, placed, k.data());
            mem.write_v(l, placed, v.data());
            const auto [part, local] = where(mem, l);
            for (std::size_t i = 0; i < n; ++i) {
                toks[part][i].k[local].assign(k.begin() + static_cast<std::ptrdiff_t>(i * sh.k_row_size()),
                                              k.begin() + static_cast<std::ptrdiff_t>((i + 1) * sh.k_row_size()));
                toks[part][i].v[local].assign(v.begin() + static_cast<std::ptrdiff_t>(i * sh.v_row_size()),
                                              v.begin() + static_cast<std::ptrdiff_t>((i + 1) * sh.v_row_size()));
            }
        }
        ++next_value;
        for (std::size_t p = 0; p < n_parts<M>; ++p) {
            model[p].begin_place();
            for (std::size_t i = 0; i < n; ++i)
                b.seqs[i].for_each([&](seq_id_t s) { model[p].put(s, b.pos[i], toks[p][i]); });
        }
    }
    void op_place(reader& in, long arm_n, int n_ubatch) {
        op = "place";
        bool placed_any = false;
        for (int u = 0; u < n_ubatch; ++u) {
            const ubatch b = decode_batch(in);
            {
                std::ostringstream os;
                os << "place";
                for (std::size_t i = 0; i < b.pos.size(); ++i) {
                    os << ' ' << b.pos[i] << '@';
                    b.seqs[i].for_each([&](seq_id_t q) { os << q; });
                }
                op = os.str();
            }
            using placed_t = std::conditional_t<is_iswa<M>, iswa_placement, placement>;
            placed_t placed;
            const bool ok = attempt(
                u == 0 ? arm_n : 0,
                [&]() -> std::optional<errc> {
                    auto r = mem.place(std::span<const pos_t>(b.pos), std::span<const seq_set>(b.seqs));
                    if (!r) return r.code();
                    placed = std::move(r.value());
                    return std::nullopt;
                },
                // iswa_cache asks its ring part for room before the full part checks the
                // batch rules: an invalid batch that does not fit may read no_space there.
                [&](const call_result& r) { return b.valid ? room_or_history(r) : invalid(r) || (is_iswa<M> && room_or_history(r)); });
            if (!ok) break;
            if (!b.valid) fail("a batch breaking the position rule was accepted");
            placed_any = true;
            if constexpr (is_iswa<M>) write_and_record(placed, b);
            else write_and_record(placed.cells, b);
        }
        const bool do_commit = (in.byte() & 3) != 0;
        const long arm2 = (in.byte() & 3) == 0 ? 1 + in.upto(16) : 0;
        if (do_commit) {
            op += " + commit";
            bool done = false;
            const bool ok = attempt(arm2, [&]() -> std::optional<errc> {
                done = mem.commit() == tx_result::committed;
                return std::nullopt;
            }, [](const call_result&) { return false; });
            if (!ok) {  // bad_alloc from the ring's pruning: still open, nothing changed
                if (mem.in_transaction() != placed_any) fail("the transaction state changed on a failed commit");
                done = mem.commit() == tx_result::committed;
            }
            if (done != placed_any) fail("commit() reported " + std::to_string(done));
            for (std::size_t p = 0; p < n_parts<M>; ++p) {
                model[p].commit();
                if (windows[p] != 0 && placed_any) model[p].prune(windows[p]);
            }
        } else {
            op += " + restore";
            if ((mem.restore() == tx_result::restored) != placed_any) fail("restore() result");
            for (auto& m : model) m.restore();
        }
    }

    // ------------------------------------------------------------ sequence operations
    /// Whether seq_cp(src, dst) may meet a position dst already holds (then the cache may
    /// refuse it as invalid: the model cannot tell whether the cells are the same).
    bool cp_may_clash(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
        if (src == dst) return false;
        for (const auto& e : seq(src))
            if (layout_model::in(e.first, p0, p1) && seq(dst).count(e.first)) return true;
        return false;
    }
    void op_seq(reader& in, long arm_n, int which) {
        pos_t p0, p1;
        switch (which) {
            case 0: {  // seq_rm
                const seq_id_t s = any_seq(in, true);
                range(in, p0, p1);
                op = "seq_rm(" + std::to_string(s) + ", " + std::to_string(p0) + ", " + std::to_string(p1) + ")";
                if (attempt(arm_n, [&] { return code_of(mem.seq_rm(s, p0, p1)); }, history_only))
                    for (auto& m : model) m.seq_rm(s, p0, p1);
                break;
            }
            case 1: {  // seq_cp
                const seq_id_t src = any_seq(in, false), dst = any_seq(in, false);
                range(in, p0, p1);
                op = "seq_cp(" + std::to_string(src) + ", " + std::to_string(dst) + ", " + std::to_string(p0) + ", " +
                     std::to_string(p1) + ")";
                const bool clash = cp_may_clash(src, dst, p0, p1);
                if (attempt(arm_n, [&] { return code_of(mem.seq_cp(src, dst, p0, p1)); },
                            [&](const call_result& r) { return room_or_history(r) || (clash && invalid(r)); }))
                    for (auto& m : model) m.seq_cp(src, dst, p0, p1);
                break;
            }
            case 2: {  // seq_keep
                const seq_id_t s = any_seq(in, false);
                op = "seq_keep(" + std::to_string(s) + ")";
                if (attempt(arm_n, [&]() -> std::optional<errc> { mem.seq_keep(s); return std::nullopt; }, history_only))
                    for (auto& m : model) m.seq_keep(s);
                break;
            }
            case 3: {  // seq_add
                const seq_id_t s = any_seq(in, true);
                range(in, p0, p1);
                const pos_t d = static_cast<pos_t>(in.upto(41)) - 20;
                op = "seq_add(" + std::to_string(s) + ", " + std::to_string(p0) + ", " + std::to_string(p1) + ", " +
                     std::to_string(d) + ")";
                if (attempt(arm_n, [&] { return code_of(mem.seq_add(s, p0, p1, d)); }, room_or_history))
                    for (auto& m : model) m.seq_add(s, p0, p1, d);
                break;
            }
            default: {  // seq_div
                const seq_id_t s = any_seq(in, true);
                range(in, p0, p1);
                const int d = 1 + in.upto(4);
                op = "seq_div(" + std::to_string(s) + ", " + std::to_string(p0) + ", " + std::to_string(p1) + ", " +
                     std::to_string(d) + ")";
                if (attempt(arm_n, [&] { return code_of(mem.seq_div(s, p0, p1, d)); }, room_or_history))
                    for (auto& m : model) m.seq_div(s, p0, p1, d);
                break;
            }
        }
    }

    // ------------------------------------------------------------ K-shift
    /// The model after a K-shift: K of every moved token rotated by its pending delta.
    std::vector<model_seq> rotated(const layout_model& m) const {
        const model_shape& sh = shape_of(mem);
        std::vector<model_seq> out = m.seqs;
        for (auto& sq : out)
            for (auto& [p, t] : sq) {
                if (t.shift != 0)
                    for (auto& row : t.k)
                        for (std::uint32_t h = 0; h < sh.n_head_kv; ++h) {
                            std::vector<double> x(row.begin() + h * sh.head_dim_k, row.begin() + (h + 1) * sh.head_dim_k);
                            const auto y = ref::rope_head(x, t.shift, sh.rope);
                            for (std::uint32_t d = 0; d < sh.head_dim_k; ++d)
                                row[h * sh.head_dim_k + d] = static_cast<float>(y[d]);
                        }
                t.shift = 0;
            }
        return out;
    }
    /// Compares with a tolerance on K (the rotation rounds in float); then the model takes
    /// the cache's K, so rounding never accumulates.
    void check_rotated(std::size_t part, const std::vector<model_seq>& want, const std::vector<model_seq>& got) {
        for (std::size_t s = 0; s < want.size(); ++s) {
            const auto a = kvtest::sorted(want[s]), b = kvtest::sorted(got[s]);
            bool ok = a.size() == b.size();
            for (std::size_t i = 0; ok && i < a.size(); ++i) {
                ok = a[i].first == b[i].first && b[i].second.shift == 0 && a[i].second.v == b[i].second.v;
                for (std::size_t l = 0; ok && l < a[i].second.k.size(); ++l)
                    for (std::size_t d = 0; ok && d < a[i].second.k[l].size(); ++d)
                        ok = std::fabs(a[i].second.k[l][d] - b[i].second.k[l][d]) < 1e-4f;
            }
            if (!ok) fail("K-shift: part " + std::to_string(part) + ": " + kvtest::diff(got, want));
        }
        model[part].seqs = got;
    }
    void op_kshift(long arm_n) {
        op = "apply_k_shift";
        if (!attempt(arm_n, [&]() -> std::optional<errc> { ops::apply_k_shift(mem, 1); return std::nullopt; },
                     [](const call_result&) { return false; }))
            return;
        for_parts(mem, [&](std::size_t p, const auto& c, std::uint32_t) {
            check_rotated(p, rotated(model[p]), kvtest::observe(c));
        });
    }

    // ------------------------------------------------------------ compound operations
    void op_context_shift(reader& in, long arm_n) {
        const seq_id_t s = any_seq(in, false);
        const pos_t n_past = model_max(s) + 1;
        const pos_t n_keep = static_cast<pos_t>(in.upto(n_past + 2)) - (in.byte() == 0xff ? 1 : 0);
        const pos_t discard = static_cast<pos_t>(in.upto(std::max<pos_t>(n_past - n_keep, 0) + 2));
        op = "context_shift(" + std::to_string(s) + ", " + std::to_string(n_keep) + ", " + std::to_string(discard) + ")";
        const bool valid = n_keep >= 0 && n_keep <= n_past && discard >= 1 && discard <= n_past - n_keep;
        if (attempt(arm_n, [&] { return code_of(ops::context_shift(mem, s, n_keep, discard)); },
                    [&](const call_result& r) { return valid ? room_or_history(r) : invalid(r); })) {
            if (!valid) fail("invalid context shift accepted");
            for (auto& m : model) {
                m.seq_rm(s, n_keep, n_keep + discard);
                m.seq_add(s, n_keep + discard, -1, -discard);
            }
        }
    }
    void op_defrag(long arm_n) {
        op = "defrag";
        if constexpr (std::is_same_v<M, contig_t>) {
            ops::defrag_params dp;
            dp.threshold = 0.0f;
            dp.min_cells = 0;
            attempt(arm_n, [&]() -> std::optional<errc> { static_cast<void>(ops::defrag(mem, dp)); return std::nullopt; },
                    [](const call_result&) { return false; });
        }
    }
    /// Known limitation (found by this fuzzer, not fixed yet): on the paged layout a whole
    /// state whose cells are shared by several sequences in patterns that seq_cp built
    /// (blocks shared by refcount) can need more blocks when loaded, where every distinct
    /// set of sequences gets blocks of its own: load_state refuses it with no_space, also
    /// into an empty cache of the same shape (regression input
    /// api_corpus/regress_paged_state_needs_more_blocks). Counted, not a failure.
    static bool paged_load_limit(const call_result& r) {
        if (!std::is_same_v<M, paged_t> || r.what != outcome::refused_result || r.code != errc::no_space) return false;
        ++stats.paged_load_no_space;
        return true;
    }
    void op_state(long arm_n) {
        op = "save_state -> load_state";
        const std::vector<std::byte> bytes = io::save_state(mem);
        {
            M twin = make_memory<M>();
            auto r = io::load_state(twin, bytes);
            if (!r && paged_load_limit({outcome::refused_result, r.code()})) return;
            if (!r) fail("the saved state does not load into a fresh memory: " + r.message());
            for_parts(mem, [&](std::size_t p, const auto& c, std::uint32_t) {
                (void)c;
                for_parts(twin, [&](std::size_t q, const auto& t, std::uint32_t) {
                    if (p == q && !kvtest::same(kvtest::observe(t), model[p].seqs))
                        fail("the loaded copy differs: " + kvtest::diff(kvtest::observe(t), model[p].seqs));
                });
            });
        }
        attempt(arm_n, [&] { return code_of(io::load_state(mem, bytes)); }, paged_load_limit);
    }
    void op_clear(long arm_n) {
        op = "clear";
        if (attempt(arm_n, [&]() -> std::optional<errc> { mem.clear(); return std::nullopt; },
                    [](const call_result&) { return false; }))
            for (auto& m : model) m.clear();
    }
    /// Calls every valid cache must refuse with invalid_argument.
    void op_invalid(reader& in, long arm_n) {
        const int k = in.upto(8);
        op = "invalid call " + std::to_string(k);
        const seq_id_t bad = static_cast<seq_id_t>(n_seq + in.upto(3));
        const std::vector<pos_t> neg{static_cast<pos_t>(in.upto(5)), -1};
        const std::vector<seq_id_t> two{0, 0}, out_of_range{bad};
        const std::vector<pos_t> one{static_cast<pos_t>(in.upto(5))};
        const bool ok = attempt(
            arm_n,
            [&]() -> std::optional<errc> {
                switch (k) {
                    case 0: return code_of(mem.seq_rm(bad, 0, -1));
                    case 1: return code_of(mem.seq_rm(0, 10, 5));
                    case 2: return code_of(mem.seq_cp(0, -1, 0, -1));
                    case 3: mem.seq_keep(bad); return std::nullopt;
                    case 4: return code_of(mem.seq_div(0, 0, -1, 0));
                    case 5: return code_of(mem.place(std::span<const pos_t>(neg), std::span<const seq_id_t>(two)));
                    case 6: return code_of(mem.place(std::span<const pos_t>(one), std::span<const seq_id_t>(out_of_range)));
                    default: return code_of(ops::context_shift(mem, 0, -1, 1));
                }
            },
            invalid);
        if (ok) fail("an invalid call was accepted");
    }

    void go(reader& in) {
        const bool trace = std::getenv("KVFUZZ_TRACE") != nullptr;  // one line per step
        check_all();
        while (!in.done() && step < max_ops) {
            const std::uint8_t opcode = in.byte();
            const std::uint8_t fault = in.byte();
            const long arm_n = (fault & 3) == 0 ? 1 + (fault >> 2) : 0;  // a quarter of the operations
            switch (opcode % 16) {
                case 0: case 1: case 2: op_place(in, arm_n, 1); break;
                case 3: op_place(in, arm_n, 2); break;
                case 4: case 5: op_seq(in, arm_n, 0); break;
                case 6: op_seq(in, arm_n, 1); break;
                case 7: op_seq(in, arm_n, 2); break;
                case 8: case 9: op_seq(in, arm_n, 3); break;
                case 10: op_seq(in, arm_n, 4); break;
                case 11: op_kshift(arm_n); break;
                case 12: op_context_shift(in, arm_n); break;
                case 13: op_state(arm_n); break;
                case 14: if ((opcode >> 4) == 0) op_clear(arm_n); else op_defrag(arm_n); break;
                default: op_invalid(in, arm_n); break;
            }
            check_all();
            if (trace) std::fprintf(stderr, "kvfuzz_api: step %zu %s: %ld live allocations\n", step, op.c_str(), kvtest::fi::live.load());
            ++step;
        }
    }
};

/// Runs one input: its first byte picks the memory, the rest is the program.
inline int run_one(const std::uint8_t* data, std::size_t size) {
    if (size == 0) return 0;
    reader in{data + 1, size - 1};
    const long live_before = kvtest::fi::live.load();
    switch (data[0] % 4) {
        case 0: { run<contig_t> r("contiguous"); r.go(in); break; }
        case 1: { run<paged_t> r("paged<32>"); r.go(in); break; }
        case 2: { run<ring_t> r("ring<8>"); r.go(in); break; }
        default: { run<iswa_t> r("iswa<8>"); r.go(in); break; }
    }
    // Everything the run allocated is freed (the caches are gone): no leak, under an
    // injected failure or not. (Library statics that allocate once would show here too.)
    if (const long d = kvtest::fi::live.load() - live_before; d != 0)
        die("run", 0, "end of the input", std::to_string(d) + " allocations not freed");
    return 0;
}

}  // namespace kvapi
