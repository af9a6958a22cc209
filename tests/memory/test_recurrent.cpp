// recurrent_memory (memory/recurrent.hpp), its state files (io/recurrent.hpp) and
// hybrid_memory (memory/hybrid.hpp): the memory contract, a model-based random test against a plain reference compared after
// every step (placements with commit/restore, every sequence operation including the
// refused ones, checkpoints, state save/load), argument errors with their messages, and
// state files that are truncated, flipped or of another shape (refused, memory unchanged);
// hybrid_memory against a kv_cache and the recurrent reference run in lockstep, both
// parts changed or neither.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvcache;

static_assert(memory<recurrent_memory>);
static_assert(!kv_memory<recurrent_memory> && !composite_memory<recurrent_memory>);
static_assert(recurrent_memory::can_shift);

recurrent_shape rec_test_shape(std::uint32_t n_seq = 4) {
    recurrent_shape s;
    s.n_layer = 2;
    s.n_seq_max = n_seq;
    s.d_conv = 3;
    s.d_inner = 4;
    s.ssm_size = 6;
    return s;
}

/// The test engine's recurrent layer: token at position p updates one layer's states
/// (the same float arithmetic on the memory's spans and on the reference).
void rec_layer_step(float* conv, float* ssm, const recurrent_shape& sh, pos_t p, std::uint32_t layer) {
    const std::size_t rows = sh.d_conv - 1, di = sh.d_inner;
    for (std::size_t r = 0; r + 1 < rows; ++r)
        for (std::size_t j = 0; j < di; ++j) conv[r * di + j] = conv[(r + 1) * di + j];
    if (rows > 0)
        for (std::size_t j = 0; j < di; ++j)
            conv[(rows - 1) * di + j] = static_cast<float>(p % 97) * 0.25f + static_cast<float>(j + layer);
    for (std::size_t k = 0; k < sh.ssm_size; ++k)
        ssm[k] = ssm[k] * 0.5f + static_cast<float>((static_cast<std::size_t>(p) * 7 + k + layer) % 13);
}

enum class rec_outcome { ok, refused, thrown };

/// Plain reference model: per sequence an interval and a state vector; a transaction
/// keeps a copy of every sequence.
struct rec_ref {
    struct seq {
        pos_t mn = -1, mx = -1;
        std::vector<float> st;
    };
    recurrent_shape sh;
    std::vector<seq> seqs;
    std::optional<std::vector<seq>> tx;

    explicit rec_ref(const recurrent_shape& s) : sh(s), seqs(s.n_seq_max) {
        for (auto& q : seqs) q.st.assign(s.seq_floats(), 0.0f);
    }
    [[nodiscard]] bool valid(seq_id_t s) const { return s >= 0 && s < static_cast<seq_id_t>(sh.n_seq_max); }
    void empty(seq& q) const {
        q.mn = q.mx = -1;
        std::fill(q.st.begin(), q.st.end(), 0.0f);
    }
    static std::int64_t lo_of(pos_t p0) { return p0 < 0 ? 0 : p0; }
    static std::int64_t hi_of(pos_t p1) { return p1 < 0 ? std::int64_t{1} << 31 : p1; }
    // 0: range misses the interval, 1: cuts it, 2: covers it
    static int how(const seq& q, std::int64_t lo, std::int64_t hi) {
        if (q.mx < 0 || hi <= q.mn || lo > q.mx) return 0;
        return lo <= q.mn && hi > q.mx ? 2 : 1;
    }
    std::vector<seq_id_t> all_or(seq_id_t s) const {
        std::vector<seq_id_t> t;
        for (seq_id_t x = 0; x < static_cast<seq_id_t>(sh.n_seq_max); ++x)
            if (s < 0 || x == s) t.push_back(x);
        return t;
    }

    rec_outcome place(const std::vector<pos_t>& pos, const std::vector<seq_id_t>& sq) {
        if (pos.size() != sq.size()) return rec_outcome::thrown;
        std::vector<pos_t> last(sh.n_seq_max);
        for (std::size_t s = 0; s < sh.n_seq_max; ++s) last[s] = seqs[s].mx;
        for (std::size_t i = 0; i < pos.size(); ++i) {
            if (!valid(sq[i]) || pos[i] < 0 || pos[i] <= last[static_cast<std::size_t>(sq[i])]) return rec_outcome::thrown;
            last[static_cast<std::size_t>(sq[i])] = pos[i];
        }
        if (pos.empty()) return rec_outcome::ok;
        if (!tx) tx = seqs;
        for (std::size_t i = 0; i < pos.size(); ++i) {
            seq& q = seqs[static_cast<std::size_t>(sq[i])];
            if (q.mn < 0) q.mn = pos[i];
            q.mx = pos[i];
        }
        return rec_outcome::ok;
    }
    void run(const std::vector<pos_t>& pos, const std::vector<seq_id_t>& sq) {
        for (std::size_t i = 0; i < pos.size(); ++i)
            for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
                float* base = seqs[static_cast<std::size_t>(sq[i])].st.data() + l * sh.layer_floats();
                rec_layer_step(base, base + sh.conv_floats(), sh, pos[i], l);
            }
    }
    rec_outcome rm(seq_id_t s, pos_t p0, pos_t p1) {
        if (tx || s >= static_cast<seq_id_t>(sh.n_seq_max) || lo_of(p0) > hi_of(p1)) return rec_outcome::thrown;
        for (seq_id_t t : all_or(s))
            if (how(seqs[static_cast<std::size_t>(t)], lo_of(p0), hi_of(p1)) == 1) return rec_outcome::refused;
        for (seq_id_t t : all_or(s))
            if (how(seqs[static_cast<std::size_t>(t)], lo_of(p0), hi_of(p1)) == 2) empty(seqs[static_cast<std::size_t>(t)]);
        return rec_outcome::ok;
    }
    rec_outcome cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
        if (tx || !valid(src) || !valid(dst) || lo_of(p0) > hi_of(p1)) return rec_outcome::thrown;
        if (src == dst) return rec_outcome::ok;
        const int h = how(seqs[static_cast<std::size_t>(src)], lo_of(p0), hi_of(p1));
        if (h == 0) return rec_outcome::ok;
        if (seqs[static_cast<std::size_t>(dst)].mx >= 0) return rec_outcome::thrown;
        if (h == 1) return rec_outcome::refused;
        seqs[static_cast<std::size_t>(dst)] = seqs[static_cast<std::size_t>(src)];
        return rec_outcome::ok;
    }
    rec_outcome keep(seq_id_t s) {
        if (tx || !valid(s)) return rec_outcome::thrown;
        for (seq_id_t t : all_or(-1))
            if (t != s) empty(seqs[static_cast<std::size_t>(t)]);
        return rec_outcome::ok;
    }
    // seq_add (div == 0) or seq_div by div (delta ignored; div < 0 stands for d <= 0)
    rec_outcome move(seq_id_t s, pos_t p0, pos_t p1, pos_t delta, int div) {
        if (tx || s >= static_cast<seq_id_t>(sh.n_seq_max) || lo_of(p0) > hi_of(p1)) return rec_outcome::thrown;
        if (div < 0) return rec_outcome::thrown;
        if ((div == 0 && delta == 0) || div == 1) return rec_outcome::ok;
        auto f = [&](std::int64_t p) { return div == 0 ? p + delta : p / div; };
        for (seq_id_t t : all_or(s)) {
            const seq& q = seqs[static_cast<std::size_t>(t)];
            const int h = how(q, lo_of(p0), hi_of(p1));
            if (h == 0) continue;
            if (h == 1) return rec_outcome::refused;
            if (f(q.mx) > 2147483647) return rec_outcome::thrown;
            if (f(q.mn) < 0 && f(q.mx) >= 0) return rec_outcome::refused;
        }
        for (seq_id_t t : all_or(s)) {
            seq& q = seqs[static_cast<std::size_t>(t)];
            if (how(q, lo_of(p0), hi_of(p1)) != 2) continue;
            if (f(q.mx) < 0) {
                empty(q);
            } else {
                q.mn = static_cast<pos_t>(f(q.mn));
                q.mx = static_cast<pos_t>(f(q.mx));
            }
        }
        return rec_outcome::ok;
    }
};

void rec_check_same(const recurrent_memory& m, const rec_ref& ref) {
    REQUIRE(m.in_transaction() == ref.tx.has_value());
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(m.n_seq_max()); ++s) {
        const auto& q = ref.seqs[static_cast<std::size_t>(s)];
        REQUIRE(m.seq_pos_min(s) == q.mn);
        REQUIRE(m.seq_pos_max(s) == q.mx);
        const auto st = m.seq_state(s);
        REQUIRE(st.size() == q.st.size());
        REQUIRE(std::memcmp(st.data(), q.st.data(), st.size_bytes()) == 0);
    }
}

/// Runs f and reports how it ended; a refusal must be an error result, a throw a kvcache::error.
template <class F>
rec_outcome rec_run(F&& f) {
    const kvtest::refusal r = kvtest::run_refusal(f);
    if (r.kind == kvtest::refusal_kind::none) return rec_outcome::ok;
    if (r.kind == kvtest::refusal_kind::returned) {
        CHECK(r.code == errc::unsupported);
        CHECK(r.message.find("refused by history") != std::string::npos);
        return rec_outcome::refused;
    }
    CHECK((r.code == errc::invalid_argument || r.code == errc::transaction_open));
    return rec_outcome::thrown;
}

/// The engine's part of a batch: runs the test layer over the placed tokens.
void rec_engine_run(recurrent_memory& m, const recurrent_placement& p, const std::vector<pos_t>& pos) {
    const recurrent_shape& sh = m.shape();
    for (std::size_t i = 0; i < pos.size(); ++i)
        for (std::uint32_t l = 0; l < sh.n_layer; ++l)
            rec_layer_step(m.conv_state(l, p.slots[i]).data(), m.ssm_state(l, p.slots[i]).data(), sh, pos[i], l);
}

pos_t rec_pick_pos(std::mt19937& rng, const rec_ref::seq& q) {
    switch (rng() % 6) {
        case 0: return -1;
        case 1: return q.mn < 0 ? 0 : q.mn;
        case 2: return q.mx < 0 ? 3 : q.mx;
        case 3: return q.mx < 0 ? 5 : q.mx + 1;
        case 4: return q.mn < 0 ? 1 : q.mn + 1;
        default: return static_cast<pos_t>(rng() % 40);
    }
}

}  // namespace

TEST_CASE("recurrent_memory: model-based random test against a reference, every step compared") {
    for (std::uint32_t seed = 1; seed <= 6; ++seed) {
        CAPTURE(seed);
        std::mt19937 rng(seed);
        const recurrent_shape sh = rec_test_shape(seed % 2 == 0 ? 4 : 3);
        const auto n_seq = static_cast<seq_id_t>(sh.n_seq_max);
        recurrent_memory mem(sh);
        rec_ref ref(sh);
        std::vector<std::pair<recurrent_checkpoint, rec_ref::seq>> cps;
        int n_ok = 0, n_refused = 0, n_thrown = 0;
        auto tally = [&](rec_outcome o) { (o == rec_outcome::ok ? n_ok : o == rec_outcome::refused ? n_refused : n_thrown)++; };
        auto any_seq = [&]() -> seq_id_t { return static_cast<seq_id_t>(rng() % (n_seq + 2)) - 1; };  // -1 .. n_seq
        for (int step = 0; step < 800; ++step) {
            CAPTURE(step);
            const unsigned op = rng() % 100;
            if (op < 30) {  // place a batch of 1..3 sequences; sometimes an invalid one
                std::vector<pos_t> pos;
                std::vector<seq_id_t> sq;
                const unsigned n_s = 1 + rng() % 3;
                std::vector<std::vector<std::pair<seq_id_t, pos_t>>> per;
                for (unsigned k = 0; k < n_s; ++k) {
                    const auto s = static_cast<seq_id_t>(rng() % static_cast<unsigned>(n_seq));
                    bool dup = false;
                    for (const auto& v : per) dup |= v.front().first == s;
                    if (dup) continue;
                    const auto& q = ref.seqs[static_cast<std::size_t>(s)];
                    pos_t p = q.mx < 0 ? static_cast<pos_t>(rng() % 20) : q.mx + 1 + (rng() % 4 == 0 ? static_cast<pos_t>(rng() % 3) : 0);
                    per.emplace_back();
                    for (unsigned t = 0, nt = 1 + rng() % 3; t < nt; ++t) per.back().emplace_back(s, p++);
                }
                while (true) {  // interleave, keeping each sequence's order
                    std::vector<std::size_t> live;
                    for (std::size_t k = 0; k < per.size(); ++k)
                        if (!per[k].empty()) live.push_back(k);
                    if (live.empty()) break;
                    auto& v = per[live[rng() % live.size()]];
                    sq.push_back(v.front().first);
                    pos.push_back(v.front().second);
                    v.erase(v.begin());
                }
                if (rng() % 8 == 0) {  // break it
                    const std::size_t i = rng() % pos.size();
                    switch (rng() % 4) {
                        case 0: pos[i] = ref.seqs[static_cast<std::size_t>(sq[i])].mx; break;  // not after the last
                        case 1: sq[i] = n_seq; break;
                        case 2: pos[i] = -2; break;
                        default: sq.pop_back(); break;  // sizes differ
                    }
                }
                const rec_outcome want = ref.place(pos, sq);
                std::optional<recurrent_placement> pl;
                const rec_outcome got = rec_run([&] {
                    auto r = mem.place(pos, sq);
                    if (r) pl = std::move(r.value());
                    return r;
                });
                REQUIRE(got == want);
                tally(got);
                if (got == rec_outcome::ok) {
                    REQUIRE(pl->slots.size() == pos.size());
                    for (std::size_t i = 0; i < pos.size(); ++i) REQUIRE(pl->slots[i] == sq[i]);
                    rec_engine_run(mem, *pl, pos);
                    ref.run(pos, sq);
                    if (const unsigned end = rng() % 10; end < 7) {  // usually the batch ends here
                        REQUIRE(mem.commit() == tx_result::committed);
                        ref.tx.reset();
                    } else if (end < 9) {
                        REQUIRE(mem.restore() == tx_result::restored);
                        ref.seqs = *ref.tx;
                        ref.tx.reset();
                    }
                }
            } else if (op < 40) {
                const tx_result want = ref.tx ? tx_result::committed : tx_result::nothing_staged;
                ref.tx.reset();
                REQUIRE(mem.commit() == want);
            } else if (op < 48) {
                const tx_result want = ref.tx ? tx_result::restored : tx_result::nothing_staged;
                if (ref.tx) ref.seqs = *ref.tx;
                ref.tx.reset();
                REQUIRE(mem.restore() == want);
            } else if (op < 58) {
                const seq_id_t s = any_seq();
                const auto& q = ref.seqs[static_cast<std::size_t>(s < 0 || s >= n_seq ? 0 : s)];
                const pos_t p0 = rec_pick_pos(rng, q), p1 = rec_pick_pos(rng, q);
                const rec_outcome want = ref.rm(s, p0, p1);
                const rec_outcome got = rec_run([&] { return mem.seq_rm(s, p0, p1); });
                REQUIRE(got == want);
                tally(got);
            } else if (op < 66) {
                const seq_id_t src = any_seq(), dst = any_seq();
                const auto& q = ref.seqs[static_cast<std::size_t>(src < 0 || src >= n_seq ? 0 : src)];
                const pos_t p0 = rng() % 2 ? -1 : rec_pick_pos(rng, q), p1 = rng() % 2 ? -1 : rec_pick_pos(rng, q);
                if (dst >= 0 && dst < n_seq && rng() % 2 == 0 && !ref.tx) {  // usually an empty destination
                    REQUIRE(mem.seq_rm(dst, -1, -1));
                    REQUIRE(ref.rm(dst, -1, -1) == rec_outcome::ok);
                }
                const rec_outcome want = ref.cp(src, dst, p0, p1);
                const rec_outcome got = rec_run([&] { return mem.seq_cp(src, dst, p0, p1); });
                REQUIRE(got == want);
                tally(got);
            } else if (op < 68) {
                const seq_id_t s = any_seq();
                const rec_outcome want = ref.keep(s);
                REQUIRE(rec_run([&] { mem.seq_keep(s); }) == want);
            } else if (op < 76) {
                const seq_id_t s = any_seq();
                const auto& q = ref.seqs[static_cast<std::size_t>(s < 0 || s >= n_seq ? 0 : s)];
                const pos_t p0 = rng() % 2 ? -1 : rec_pick_pos(rng, q), p1 = rng() % 2 ? -1 : rec_pick_pos(rng, q);
                const pos_t delta = rng() % 10 == 0 ? 2147483000 : static_cast<pos_t>(rng() % 21) - 12;
                const rec_outcome want = ref.move(s, p0, p1, delta, 0);
                const rec_outcome got = rec_run([&] { return mem.seq_add(s, p0, p1, delta); });
                REQUIRE(got == want);
                tally(got);
            } else if (op < 80) {
                const seq_id_t s = any_seq();
                const auto& q = ref.seqs[static_cast<std::size_t>(s < 0 || s >= n_seq ? 0 : s)];
                const pos_t p0 = rng() % 2 ? -1 : rec_pick_pos(rng, q), p1 = rng() % 2 ? -1 : rec_pick_pos(rng, q);
                const int d = static_cast<int>(rng() % 5) - 1;  // -1 .. 3
                const rec_outcome want = ref.move(s, p0, p1, 0, d <= 0 ? -1 : d);
                const rec_outcome got = rec_run([&] { return mem.seq_div(s, p0, p1, d); });
                REQUIRE(got == want);
                tally(got);
            } else if (op < 81) {
                mem.clear();
                for (auto& q : ref.seqs) ref.empty(q);
                ref.tx.reset();
            } else if (op < 88) {  // whole memory: save, load into a fresh memory and back
                const std::vector<token_t> toks = {1, 2, static_cast<token_t>(step)};
                const std::vector<std::byte> bytes = io::save_state(mem, toks);
                REQUIRE(bytes.size() == io::state_size(mem, toks));
                recurrent_memory other(sh);
                auto r = io::load_state(other, bytes);
                REQUIRE(r);
                CHECK(r.value().tokens == toks);
                rec_ref copy = ref;
                copy.tx.reset();
                rec_check_same(other, copy);
                if (!ref.tx) {
                    std::vector<std::byte> bad = bytes;
                    bad[rng() % bad.size()] ^= std::byte{static_cast<unsigned char>(1u << (rng() % 8))};
                    REQUIRE_FALSE(io::load_state(mem, bad));
                    rec_check_same(mem, ref);
                    REQUIRE_FALSE(io::load_state(mem, std::span(bytes).first(rng() % bytes.size())));
                    rec_check_same(mem, ref);
                    REQUIRE(io::load_state(mem, io::save_state(other)));  // round trip
                } else {
                    REQUIRE(rec_run([&] { return io::load_state(mem, bytes); }) == rec_outcome::thrown);
                }
            } else if (op < 94) {  // one sequence into another
                const auto src = static_cast<seq_id_t>(rng() % static_cast<unsigned>(n_seq));
                const auto dst = static_cast<seq_id_t>(rng() % static_cast<unsigned>(n_seq));
                const std::vector<std::byte> bytes = io::save_seq(mem, src);
                REQUIRE(bytes.size() == io::seq_state_size(mem, src));
                if (ref.tx) {
                    REQUIRE(rec_run([&] { return io::load_seq(mem, dst, bytes); }) == rec_outcome::thrown);
                } else {
                    auto r = io::load_seq(mem, dst, bytes);
                    REQUIRE(r);
                    CHECK(r.value().saved_seq == src);
                    ref.seqs[static_cast<std::size_t>(dst)] = ref.seqs[static_cast<std::size_t>(src)];
                }
            } else {  // checkpoints
                const auto s = static_cast<seq_id_t>(rng() % static_cast<unsigned>(n_seq));
                if (cps.empty() || rng() % 2 == 0) {
                    cps.emplace_back(mem.take_checkpoint(s), ref.seqs[static_cast<std::size_t>(s)]);
                } else {
                    const auto& entry = cps[rng() % cps.size()];  // no structured binding: clang 14 cannot capture one
                    const recurrent_checkpoint& cp = entry.first;
                    const rec_ref::seq& rq = entry.second;
                    if (ref.tx) {
                        REQUIRE(rec_run([&] { mem.restore_checkpoint(s, cp); }) == rec_outcome::thrown);
                    } else {
                        mem.restore_checkpoint(s, cp);
                        ref.seqs[static_cast<std::size_t>(s)] = rq;
                    }
                }
            }
            rec_check_same(mem, ref);
        }
        // The random walk reached every outcome.
        CHECK(n_ok > 50);
        CHECK(n_refused > 5);
        CHECK(n_thrown > 5);
    }
}

TEST_CASE("recurrent_memory: shape validation names the field") {
    auto msg = [](recurrent_shape s) {
        try {
            recurrent_memory m(s);
        } catch (const kvcache::error& e) {
            CHECK(e.code() == errc::invalid_config);
            return std::string(e.what());
        }
        return std::string("no error");
    };
    recurrent_shape s = rec_test_shape();
    s.n_layer = 0;
    CHECK(msg(s).find("recurrent_shape.n_layer = 0") != std::string::npos);
    s = rec_test_shape(0);
    CHECK(msg(s).find("recurrent_shape.n_seq_max = 0") != std::string::npos);
    s = rec_test_shape(KVCACHE_MAX_SEQ + 1);
    CHECK(msg(s).find("n_seq_max") != std::string::npos);
    s = rec_test_shape();
    s.d_conv = 0;
    CHECK(msg(s).find("recurrent_shape.d_conv = 0") != std::string::npos);
    s = rec_test_shape();
    s.d_inner = 0;
    CHECK(msg(s).find("recurrent_shape.d_inner = 0") != std::string::npos);
    s = rec_test_shape();
    s.d_conv = 1;
    s.ssm_size = 0;
    CHECK(msg(s).find("recurrent_shape.ssm_size = 0") != std::string::npos);
    s = rec_test_shape();
    s.n_layer = 1u << 10;
    s.d_inner = 1u << 30;
    s.ssm_size = 1u << 30;
    CHECK(msg(s).find("2^40") != std::string::npos);
    s = rec_test_shape();
    s.d_conv = 1;  // no convolution state: valid
    recurrent_memory m(s);
    CHECK(m.conv_state(0, 0).empty());
    CHECK(m.ssm_state(1, 0).size() == 6);
    CHECK(m.total_bytes() == s.seq_floats() * s.n_seq_max * sizeof(float));
}

TEST_CASE("recurrent_memory: buffers zeroed, accessors, accounting, argument errors") {
    const recurrent_shape sh = rec_test_shape();
    recurrent_memory m(sh);
    CHECK(m.total_bytes() == std::size_t{4} * 2 * (2 * 4 + 6) * sizeof(float));
    CHECK(m.n_layer() == 2);
    CHECK(m.n_seq_max() == 4);
    CHECK_FALSE(m.has_shift());
    for (seq_id_t s = 0; s < 4; ++s) {
        CHECK(m.seq_pos_min(s) == -1);
        CHECK(m.seq_pos_max(s) == -1);
        for (float x : m.seq_state(s)) CHECK(x == 0.0f);
    }
    CHECK(m.conv_state(1, 3).size() == 8);
    CHECK(m.ssm_state(1, 3).data() == m.conv_state(1, 3).data() + 8);
    auto thrown = [](auto&& f, errc code, const std::string& needle) {
        const kvtest::refusal r = kvtest::run_refusal(f);
        CHECK(r.kind == kvtest::refusal_kind::thrown);
        CHECK(r.code == code);
        CHECK_MESSAGE(r.message.find(needle) != std::string::npos, r.message);
    };
    thrown([&] { (void)m.conv_state(2, 0); }, errc::invalid_argument, "conv_state: layer = 2, must be < n_layer = 2");
    thrown([&] { (void)m.ssm_state(0, 4); }, errc::invalid_argument, "ssm_state: seq_id = 4, must be in [0, 4)");
    thrown([&] { (void)m.seq_pos_max(-1); }, errc::invalid_argument, "seq_pos_max: seq_id = -1");
    const std::vector<pos_t> p2 = {0, 1};
    const std::vector<seq_id_t> s1 = {0}, s2 = {0, 0}, s_bad = {0, 7}, s_two = {1, 1};
    thrown([&] { return m.place(p2, s1); }, errc::invalid_argument, "place: pos has 2 entries but seq has 1");
    thrown([&] { return m.place(p2, s_bad); }, errc::invalid_argument, "place: seq[1] = 7, must be in [0, 4)");
    const std::vector<pos_t> p_neg = {0, -3}, p_down = {5, 4};
    thrown([&] { return m.place(p_neg, s2); }, errc::invalid_argument, "place: pos[1] = -3, must be >= 0");
    thrown([&] { return m.place(p_down, s_two); }, errc::invalid_argument, "sequence 1 gets position 4 (token 1) after position 5");
    CHECK_FALSE(m.in_transaction());
    REQUIRE(m.place(p2, s2));
    CHECK(m.in_transaction());
    thrown([&] { return m.seq_rm(0, -1, -1); }, errc::transaction_open, "seq_rm: placements are staged");
    thrown([&] { return m.seq_cp(0, 1, -1, -1); }, errc::transaction_open, "seq_cp");
    thrown([&] { m.seq_keep(0); }, errc::transaction_open, "seq_keep");
    thrown([&] { return m.seq_add(0, -1, -1, 1); }, errc::transaction_open, "seq_add");
    thrown([&] { return m.seq_div(0, -1, -1, 2); }, errc::transaction_open, "seq_div");
    thrown([&] { m.restore_checkpoint(0, m.take_checkpoint(1)); }, errc::transaction_open, "restore_checkpoint");
    CHECK(m.commit() == tx_result::committed);
    const std::vector<pos_t> p_again = {1};
    thrown([&] { return m.place(p_again, s1); }, errc::invalid_argument, "after position 1");
    thrown([&] { return m.seq_rm(4, -1, -1); }, errc::invalid_argument, "seq_rm: seq_id = 4, must be < 0 (all) or in [0, 4)");
    thrown([&] { return m.seq_rm(0, 5, 2); }, errc::invalid_argument, "seq_rm: reversed range [p0, p1) = [5, 2)");
    thrown([&] { return m.seq_cp(-1, 1, -1, -1); }, errc::invalid_argument, "seq_cp: src = -1");
    thrown([&] { return m.seq_div(0, -1, -1, 0); }, errc::invalid_argument, "seq_div: d = 0, must be > 0");
    thrown([&] { return m.seq_add(0, -1, -1, 2147483647); }, errc::invalid_argument, "beyond the largest position 2^31-1");
    REQUIRE(m.seq_cp(0, 1, -1, -1));
    thrown([&] { return m.seq_cp(0, 1, -1, -1); }, errc::invalid_argument, "destination sequence 1 already holds a state");
    recurrent_checkpoint cp = m.take_checkpoint(0);
    cp.state.pop_back();
    thrown([&] { m.restore_checkpoint(2, cp); }, errc::invalid_argument, "restore_checkpoint: the checkpoint holds 27 floats");
    cp = m.take_checkpoint(0);
    cp.pos_min = 3;
    thrown([&] { m.restore_checkpoint(2, cp); }, errc::invalid_argument, "interval [3, 1]");
    cp = m.take_checkpoint(3);  // empty
    cp.state[0] = 1.0f;
    thrown([&] { m.restore_checkpoint(2, cp); }, errc::invalid_argument, "must hold a zero state");
}

TEST_CASE("recurrent_memory: refusals by history leave every byte, transactions restore the bytes") {
    const recurrent_shape sh = rec_test_shape();
    recurrent_memory m(sh);
    const std::vector<pos_t> pos = {10, 11, 12, 13};
    const std::vector<seq_id_t> sq = {2, 2, 2, 2};
    auto pl = m.place(pos, sq).value();
    CHECK(pl.seqs == std::vector<seq_id_t>{2});
    rec_engine_run(m, pl, pos);
    REQUIRE(m.commit() == tx_result::committed);
    const recurrent_checkpoint before = m.take_checkpoint(2);
    auto same = [&] {
        const recurrent_checkpoint now = m.take_checkpoint(2);
        CHECK(now.pos_min == before.pos_min);
        CHECK(now.pos_max == before.pos_max);
        CHECK(std::memcmp(now.state.data(), before.state.data(), now.state.size() * sizeof(float)) == 0);
    };
    CHECK(kvtest::refused_with(m.seq_rm(2, 12, -1), errc::unsupported, "seq_rm: refused by history"));  // tail
    CHECK(kvtest::refused_with(m.seq_rm(2, 0, 11), errc::unsupported, "which holds [10, 13]"));          // head
    CHECK(kvtest::refused_with(m.seq_rm(-1, 11, 12), errc::unsupported, "sequence 2"));                  // middle
    CHECK(kvtest::refused_with(m.seq_cp(2, 0, 11, -1), errc::unsupported, "refused by history"));
    CHECK(kvtest::refused_with(m.seq_add(2, 12, -1, 5), errc::unsupported, "refused by history"));
    CHECK(kvtest::refused_with(m.seq_add(2, -1, -1, -11), errc::unsupported, "below 0"));
    CHECK(kvtest::refused_with(m.seq_div(2, 11, -1, 2), errc::unsupported, "refused by history"));
    same();
    CHECK(m.seq_pos_max(0) == -1);
    CHECK(m.seq_rm(2, 14, -1));  // misses the interval
    CHECK(m.seq_rm(2, 0, 10));
    same();
    // A batch placed, run and restored: bytes and interval back; two placements in one transaction.
    const std::vector<pos_t> more = {14, 15}, more2 = {16};
    const std::vector<seq_id_t> sq2 = {2, 2}, sq1 = {2};
    rec_engine_run(m, m.place(more, sq2).value(), more);
    rec_engine_run(m, m.place(more2, sq1).value(), more2);
    CHECK(m.seq_pos_max(2) == 16);
    CHECK(m.restore() == tx_result::restored);
    same();
    CHECK(m.restore() == tx_result::nothing_staged);
    CHECK(m.commit() == tx_result::nothing_staged);
    // The RAII guard restores too.
    {
        transaction<recurrent_memory> tx(m);
        rec_engine_run(m, m.place(more, sq2).value(), more);
    }
    same();
    // Whole-interval operations.
    REQUIRE(m.seq_add(2, 10, 14, 100));
    CHECK(m.seq_pos_min(2) == 110);
    CHECK(m.seq_pos_max(2) == 113);
    REQUIRE(m.seq_div(-1, -1, -1, 2));
    CHECK(m.seq_pos_min(2) == 55);
    CHECK(m.seq_pos_max(2) == 56);
    REQUIRE(m.seq_cp(2, 0, 0, 57));
    CHECK(std::memcmp(m.seq_state(0).data(), m.seq_state(2).data(), m.seq_state(0).size_bytes()) == 0);
    REQUIRE(m.seq_add(0, -1, -1, -100));  // wholly below 0: cleared
    CHECK(m.seq_pos_max(0) == -1);
    for (float x : m.seq_state(0)) CHECK(x == 0.0f);
    m.restore_checkpoint(1, before);  // a checkpoint serves another sequence
    CHECK(m.seq_pos_max(1) == 13);
    m.seq_keep(1);
    CHECK(m.seq_pos_max(2) == -1);
    CHECK(m.seq_pos_max(1) == 13);
    REQUIRE(m.seq_rm(1, 10, 14));  // the whole interval: cleared
    CHECK(m.seq_pos_max(1) == -1);
}

TEST_CASE("recurrent state files: round trips, bad bytes and wrong shapes refused, memory unchanged") {
    const recurrent_shape sh = rec_test_shape();
    recurrent_memory m(sh);
    const std::vector<pos_t> pos = {0, 5, 1, 2, 7};
    const std::vector<seq_id_t> sq = {0, 3, 0, 0, 3};
    rec_engine_run(m, m.place(pos, sq).value(), pos);
    REQUIRE(m.commit() == tx_result::committed);
    const std::vector<token_t> toks = {4, 5, 6};
    const std::vector<std::byte> whole = io::save_state(m, toks);
    const std::vector<std::byte> one = io::save_seq(m, 3);
    const std::vector<std::byte> empty_one = io::save_seq(m, 1);
    CHECK(whole.size() == 56 + 12 + 2 * (12 + 28 * 4) + 8);
    CHECK(empty_one.size() == 64);

    // Round trips: whole into a memory with more sequences, one sequence into another slot.
    recurrent_memory big(rec_test_shape(6));
    auto r = io::load_state(big, whole);
    REQUIRE(r);
    CHECK(r.value().cells == std::vector<std::uint32_t>{0, 3});
    CHECK(r.value().tokens == toks);
    for (seq_id_t s = 0; s < 4; ++s) {
        CHECK(big.seq_pos_min(s) == m.seq_pos_min(s));
        CHECK(std::memcmp(big.seq_state(s).data(), m.seq_state(s).data(), m.seq_state(s).size_bytes()) == 0);
    }
    REQUIRE(io::load_seq(big, 5, one));
    CHECK(big.seq_pos_min(5) == 5);
    CHECK(big.seq_pos_max(5) == 7);
    CHECK(std::memcmp(big.seq_state(5).data(), m.seq_state(3).data(), m.seq_state(3).size_bytes()) == 0);
    REQUIRE(io::load_seq(big, 5, empty_one));  // an empty sequence empties dst
    CHECK(big.seq_pos_max(5) == -1);
    for (float x : big.seq_state(5)) CHECK(x == 0.0f);
    CHECK(io::save_state(big) != whole);  // the tokens differ
    CHECK(io::save_state(big, toks) == whole);

    const recurrent_checkpoint c0 = m.take_checkpoint(0), c3 = m.take_checkpoint(3);
    auto unchanged = [&] {
        for (seq_id_t s : {0, 3}) {
            const auto c = m.take_checkpoint(s);
            const auto& w = s == 0 ? c0 : c3;
            CHECK(c.pos_min == w.pos_min);
            CHECK(c.pos_max == w.pos_max);
            CHECK(c.state == w.state);
        }
        CHECK(m.seq_pos_max(1) == -1);
    };
    // Every truncation and every single bit flip in a byte is refused.
    for (std::size_t n = 0; n < whole.size(); ++n) {
        CAPTURE(n);
        REQUIRE_FALSE(io::load_state(m, std::span(whole).first(n)));
    }
    for (std::size_t i = 0; i < whole.size(); ++i) {
        CAPTURE(i);
        std::vector<std::byte> bad = whole;
        bad[i] ^= std::byte{0x10};
        REQUIRE_FALSE(io::load_state(m, bad));
    }
    unchanged();
    std::vector<std::byte> longer = whole;
    longer.push_back(std::byte{0});
    CHECK(kvtest::refused_with(io::load_state(m, longer), errc::trailing_bytes));
    CHECK(kvtest::refused_with(io::load_state(m, std::span(whole).first(20)), errc::truncated));
    std::vector<std::byte> magic = whole;
    magic[0] = std::byte{'X'};
    CHECK(kvtest::refused_with(io::load_state(m, magic), errc::bad_magic));
    CHECK(kvtest::refused_with(io::load_state(m, one), errc::unsupported, "use load_seq"));
    CHECK(kvtest::refused_with(io::load_seq(m, 1, whole), errc::unsupported, "use load_state"));
    CHECK(kvtest::refused_with(io::load_state(m, whole, io::load_options{2}), errc::no_space, "max_tokens"));
    // Another shape (valid checksum): shape_mismatch naming the field.
    for (int f = 0; f < 4; ++f) {
        recurrent_shape o = sh;
        (f == 0 ? o.n_layer : f == 1 ? o.d_conv : f == 2 ? o.d_inner : o.ssm_size) += 1;
        recurrent_memory other(o);
        const char* name[4] = {"n_layer", "d_conv", "d_inner", "ssm_size"};
        CHECK(kvtest::refused_with(io::load_state(m, io::save_state(other)), errc::shape_mismatch, name[f]));
        CHECK(kvtest::refused_with(io::load_state(other, whole), errc::shape_mismatch, name[f]));
    }
    // A state with sequence 3 does not fit a memory of 2 sequences.
    recurrent_memory small(rec_test_shape(2));
    CHECK(kvtest::refused_with(io::load_state(small, whole), errc::no_space, "n_seq_max = 2"));
    CHECK(small.seq_pos_max(0) == -1);
    unchanged();
    // Host errors throw.
    CHECK_THROWS_AS((void)io::save_seq(m, 4), kvcache::error);
    CHECK_THROWS_AS((void)io::load_seq(m, -1, one), kvcache::error);
    const std::vector<pos_t> p1 = {9};
    const std::vector<seq_id_t> s1 = {0};
    REQUIRE(m.place(p1, s1));
    CHECK_THROWS_AS((void)io::load_state(m, whole), kvcache::error);
    CHECK(m.restore() == tx_result::restored);
    REQUIRE(io::load_state(m, whole));
    unchanged();
}

// ---------------------------------------------------------------------------
// hybrid_memory: attention layers in a kv_cache, recurrent layers in a recurrent_memory.

namespace {

using rec_hyb = hybrid_memory<kv_cache<f32>>;
static_assert(memory<rec_hyb> && !kv_memory<rec_hyb> && !composite_memory<rec_hyb>);
static_assert(memory<hybrid_memory<iswa_cache<16, f32>>>);

model_shape rec_hyb_attn_shape(std::uint32_t n_seq, std::uint32_t n_cells = 20) {
    model_shape s;
    s.n_layer = 2;
    s.n_head_kv = 1;
    s.head_dim_k = 4;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq;
    return s;
}
const std::vector<bool> rec_hyb_layers = {false, true, false, true};  // attention, recurrent, ...

/// How a hybrid call ended (any code: the attention part refuses with its own).
template <class F>
rec_outcome rec_hyb_run(F&& f) {
    const kvtest::refusal r = kvtest::run_refusal(f);
    if (r.kind == kvtest::refusal_kind::none) return rec_outcome::ok;
    return r.kind == kvtest::refusal_kind::returned ? rec_outcome::refused : rec_outcome::thrown;
}

/// The expected outcome of a sequence operation on the pair (A, R): attention first, then
/// the recurrent reference; A rolled back unless both succeed, R changed only then.
template <class FA, class FR>
rec_outcome rec_hyb_mirror(kv_cache<f32>& a, rec_ref& r, FA&& fa, FR&& fr) {
    rec_ref rc = r;
    rec_outcome want = rec_outcome::ok;
    try {
        static_cast<void>(kvcache::detail::with_rollback(a, [&]() -> result<void> {
            if (result<void> x = fa(a); !x) {
                want = rec_outcome::refused;
                return x;
            }
            want = fr(rc);
            if (want != rec_outcome::ok) return kvcache::detail::make_error(errc::unsupported, "mirror");
            return {};
        }));
    } catch (const kvcache::error&) {
        want = rec_outcome::thrown;
    }
    if (want == rec_outcome::ok) r = std::move(rc);
    return want;
}

void rec_hyb_check(const rec_hyb& h, const kv_cache<f32>& a, const rec_ref& r) {
    REQUIRE(kvtest::snapshot(h.attention()) == kvtest::snapshot(a));
    rec_check_same(h.recurrent(), r);
    REQUIRE(h.in_transaction() == a.in_transaction());
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(h.n_seq_max()); ++s) {  // both parts hold the same positions
        REQUIRE(h.seq_pos_min(s) == h.recurrent().seq_pos_min(s));
        REQUIRE(h.seq_pos_max(s) == h.recurrent().seq_pos_max(s));
    }
}

}  // namespace

TEST_CASE("hybrid_memory: model-based random test, both parts or neither, compared every step") {
    for (std::uint32_t seed = 1; seed <= 4; ++seed) {
        CAPTURE(seed);
        std::mt19937 rng(seed * 7919);
        const model_shape ash = rec_hyb_attn_shape(3);
        const recurrent_shape rsh = rec_test_shape(3);
        rec_hyb h(ash, rsh, rec_hyb_layers);
        kv_cache<f32> a(ash);
        rec_ref r(rsh);
        const seq_id_t n_seq = 3;
        int n_ok = 0, n_refused = 0, n_thrown = 0;
        auto tally = [&](rec_outcome o) { (o == rec_outcome::ok ? n_ok : o == rec_outcome::refused ? n_refused : n_thrown)++; };
        auto any_seq = [&]() -> seq_id_t { return static_cast<seq_id_t>(rng() % (n_seq + 2)) - 1; };
        auto pick = [&](seq_id_t s) { return rng() % 2 ? -1 : rec_pick_pos(rng, r.seqs[static_cast<std::size_t>(s < 0 || s >= n_seq ? 0 : s)]); };
        auto seq_op = [&](auto&& fa, auto&& fr, auto&& fh) {
            const rec_outcome want = rec_hyb_mirror(a, r, fa, fr);
            const rec_outcome got = rec_hyb_run(fh);
            REQUIRE(got == want);
            tally(got);
        };
        for (int step = 0; step < 500; ++step) {
            CAPTURE(step);
            const unsigned op = rng() % 100;
            if (op < 35) {
                std::vector<pos_t> pos;
                std::vector<seq_id_t> sq;
                const auto s = static_cast<seq_id_t>(rng() % static_cast<unsigned>(n_seq));
                const auto s2 = static_cast<seq_id_t>((static_cast<unsigned>(s) + 1 + rng() % 2) % static_cast<unsigned>(n_seq));
                for (seq_id_t t : {s, s2}) {
                    const auto& q = r.seqs[static_cast<std::size_t>(t)];
                    pos_t p = q.mx < 0 ? static_cast<pos_t>(rng() % 10) : q.mx + 1;
                    for (unsigned k = 0, n = rng() % 5; k < n; ++k) {
                        pos.push_back(p++);
                        sq.push_back(t);
                    }
                }
                if (!pos.empty() && rng() % 8 == 0) pos.back() = pos.front() - 1;  // often breaks the order
                // Expected: the recurrent rules first, then the attention cache's.
                rec_ref rc = r;
                rec_outcome want = rc.place(pos, sq);
                std::optional<placement> pa;
                if (want == rec_outcome::ok) {
                    want = rec_hyb_run([&] {
                        auto x = a.place(pos, sq);
                        if (x) pa = std::move(x.value());
                        return x;
                    });
                    if (want == rec_outcome::ok) r = std::move(rc);
                }
                std::optional<rec_hyb::placement_type> ph;
                const rec_outcome got = rec_hyb_run([&] {
                    auto x = h.place(pos, sq);
                    if (x) ph = std::move(x.value());
                    return x;
                });
                REQUIRE(got == want);
                tally(got);
                if (got == rec_outcome::ok) {
                    REQUIRE(ph->attention.cells == pa->cells);
                    std::vector<float> rows(pos.size() * 4);
                    for (std::uint32_t l : {0u, 2u}) {
                        for (float& x : rows) x = static_cast<float>(rng() % 1000) / 8.0f;
                        h.write_k(l, *ph, rows.data());
                        a.write_k(l / 2, pa->cells, rows.data());
                        for (float& x : rows) x = static_cast<float>(rng() % 1000) / 8.0f;
                        h.write_v(l, *ph, rows.data());
                        a.write_v(l / 2, pa->cells, rows.data());
                    }
                    for (std::size_t i = 0; i < pos.size(); ++i)
                        for (std::uint32_t l : {1u, 3u})
                            rec_layer_step(h.conv_state(l, sq[i]).data(), h.ssm_state(l, sq[i]).data(), rsh, pos[i], l / 2);
                    r.run(pos, sq);
                    if (pos.empty()) {  // nothing staged
                        REQUIRE(h.commit() == tx_result::nothing_staged);
                    } else if (rng() % 4 != 0) {
                        REQUIRE(h.commit() == tx_result::committed);
                        REQUIRE(a.commit() == tx_result::committed);
                        r.tx.reset();
                    } else {
                        REQUIRE(h.restore() == tx_result::restored);
                        REQUIRE(a.restore() == tx_result::restored);
                        r.seqs = *r.tx;
                        r.tx.reset();
                    }
                }
            } else if (op < 55) {
                const seq_id_t s = any_seq();
                const pos_t p0 = pick(s), p1 = pick(s);
                seq_op([&](kv_cache<f32>& c) { return c.seq_rm(s, p0, p1); }, [&](rec_ref& q) { return q.rm(s, p0, p1); },
                       [&] { return h.seq_rm(s, p0, p1); });
            } else if (op < 70) {
                const seq_id_t src = any_seq(), dst = any_seq();
                const pos_t p0 = pick(src), p1 = pick(src);
                seq_op([&](kv_cache<f32>& c) { return c.seq_cp(src, dst, p0, p1); },
                       [&](rec_ref& q) { return q.cp(src, dst, p0, p1); }, [&] { return h.seq_cp(src, dst, p0, p1); });
            } else if (op < 73) {
                const seq_id_t s = any_seq();
                seq_op(
                    [&](kv_cache<f32>& c) -> result<void> {
                        c.seq_keep(s);
                        return {};
                    },
                    [&](rec_ref& q) { return q.keep(s); }, [&] { h.seq_keep(s); });
            } else if (op < 88) {
                const seq_id_t s = any_seq();
                const pos_t p0 = pick(s), p1 = pick(s);
                const pos_t delta = static_cast<pos_t>(rng() % 21) - 12;
                seq_op([&](kv_cache<f32>& c) { return c.seq_add(s, p0, p1, delta); },
                       [&](rec_ref& q) { return q.move(s, p0, p1, delta, 0); }, [&] { return h.seq_add(s, p0, p1, delta); });
            } else if (op < 96) {
                const seq_id_t s = any_seq();
                const pos_t p0 = pick(s), p1 = pick(s);
                const int d = static_cast<int>(rng() % 4);
                seq_op([&](kv_cache<f32>& c) { return c.seq_div(s, p0, p1, d); },
                       [&](rec_ref& q) { return q.move(s, p0, p1, 0, d == 0 ? -1 : d); },
                       [&] { return h.seq_div(s, p0, p1, d); });
            } else {
                h.clear();
                a.clear();
                for (auto& q : r.seqs) r.empty(q);
            }
            rec_hyb_check(h, a, r);
        }
        CHECK(n_ok > 50);
        CHECK(n_refused > 5);
        CHECK(n_thrown > 5);
    }
}

TEST_CASE("hybrid_memory: configuration errors, layer map, wrong-kind layers, refusals change neither part") {
    const model_shape ash = rec_hyb_attn_shape(2);
    auto config_error = [&](const recurrent_shape& rs, std::vector<bool> layers, const std::string& needle) {
        try {
            rec_hyb h(ash, rs, std::move(layers));
            FAIL("no error");
        } catch (const kvcache::error& e) {
            CHECK(e.code() == errc::invalid_config);
            CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos, e.what());
        }
    };
    config_error(rec_test_shape(3), rec_hyb_layers, "recurrent_shape.n_seq_max = 3, must equal the attention memory's n_seq_max = 2");
    config_error(rec_test_shape(2), {false, true, false, true, true}, "marks 3 recurrent layers, recurrent_shape.n_layer = 2");
    config_error(rec_test_shape(2), {false, true, false, false, true}, "marks 3 attention layers");
    config_error(rec_test_shape(2), {true, true}, "no attention layer");

    rec_hyb h(ash, rec_test_shape(2), rec_hyb_layers);
    CHECK(h.n_layer() == 4);
    CHECK(h.is_recurrent(3));
    CHECK_FALSE(h.is_recurrent(2));
    CHECK(h.local_layer(3) == 1);
    CHECK(h.local_layer(2) == 1);
    CHECK(h.total_bytes() == h.attention().total_bytes() + h.recurrent().total_bytes());
    CHECK_THROWS_WITH_AS((void)h.local_layer(4), doctest::Contains("local_layer: layer = 4, must be < n_layer = 4"), kvcache::error);
    CHECK_THROWS_WITH_AS((void)h.conv_state(0, 0), doctest::Contains("conv_state: layer 0 is an attention layer"), kvcache::error);

    const std::vector<pos_t> pos = {0, 1, 2, 3};
    const std::vector<seq_id_t> sq = {0, 0, 0, 0};
    auto p = h.place(pos, sq).value();
    const std::vector<float> rows(16, 1.5f);
    CHECK_THROWS_WITH_AS(h.write_k(1, p, rows.data()), doctest::Contains("write_k: layer 1 is a recurrent layer"), kvcache::error);
    h.write_k(2, p, rows.data());
    h.conv_state(3, 0)[0] = 7.0f;
    REQUIRE(h.commit() == tx_result::committed);
    const auto before_a = kvtest::snapshot(h.attention());
    const auto before_r = h.recurrent().take_checkpoint(0);
    auto unchanged = [&] {
        CHECK(kvtest::snapshot(h.attention()) == before_a);
        const auto now = h.recurrent().take_checkpoint(0);
        CHECK(now.pos_min == before_r.pos_min);
        CHECK(now.pos_max == before_r.pos_max);
        CHECK(now.state == before_r.state);
    };
    // The attention cache would remove the tail; the recurrent state refuses: neither changes.
    CHECK(kvtest::refused_with(h.seq_rm(0, 2, -1), errc::unsupported, "refused by history"));
    CHECK(kvtest::refused_with(h.seq_add(0, 2, -1, 3), errc::unsupported, "refused by history"));
    unchanged();
    // The attention cache refuses a batch (no room): the recurrent placement is undone.
    std::vector<pos_t> big(17);
    std::vector<seq_id_t> big_seq(17, 1);
    for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<pos_t>(i);
    CHECK(kvtest::refused_with(h.place(big, big_seq), errc::no_space));
    CHECK_FALSE(h.in_transaction());
    CHECK_FALSE(h.recurrent().in_transaction());
    CHECK(h.recurrent().seq_pos_max(1) == -1);
    // The recurrent memory refuses a copy into a non-empty sequence the attention cache
    // would accept (disjoint positions): both unchanged.
    const std::vector<pos_t> p9 = {9};
    const std::vector<seq_id_t> s1 = {1};
    REQUIRE(h.place(p9, s1));
    REQUIRE(h.commit() == tx_result::committed);
    const auto before_a2 = kvtest::snapshot(h.attention());
    CHECK_THROWS_WITH_AS((void)h.seq_cp(0, 1, -1, -1), doctest::Contains("already holds a state"), kvcache::error);
    CHECK(kvtest::snapshot(h.attention()) == before_a2);
    REQUIRE(h.seq_rm(1, -1, -1));
    REQUIRE(h.seq_cp(0, 1, -1, -1));
    CHECK(h.recurrent().conv_state(1, 1)[0] == 7.0f);
    CHECK(h.seq_pos_max(1) == 3);
    // Whole-interval moves apply to both parts; the attention part records a K-shift.
    REQUIRE(h.seq_add(1, -1, -1, 10));
    CHECK(h.has_shift());
    CHECK(h.recurrent().seq_pos_min(1) == 10);
    CHECK(h.attention().seq_pos_min(1) == 10);
    h.clear();
    CHECK(h.seq_pos_max(0) == -1);
    CHECK(h.recurrent().conv_state(1, 0)[0] == 0.0f);
}

TEST_CASE("hybrid_memory over an ISWA cache: placement, writes and refusals on every part") {
    iswa_shape is;
    is.shape = rec_hyb_attn_shape(2, 64);
    is.swa_layers = {true, false};
    is.swa_n_cells = ring<16>::cells_for(2, 8);
    hybrid_memory<iswa_cache<16, f32>> h(is, rec_test_shape(2), rec_hyb_layers);
    std::vector<pos_t> pos(20);
    const std::vector<seq_id_t> sq(20, 0);
    for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<pos_t>(i);
    auto p = h.place(pos, sq).value();
    std::vector<float> rows(20 * 4, 0.5f);
    h.write_k(0, p, rows.data());  // the sliding-window layer
    h.write_v(2, p, rows.data());  // the full-attention layer
    h.ssm_state(1, 0)[2] = 3.0f;
    REQUIRE(h.commit() == tx_result::committed);
    CHECK(h.seq_pos_max(0) == 19);
    CHECK(h.recurrent().seq_pos_min(0) == 0);
    CHECK(h.attention().window_pos_min(0) > 0);  // the ring pruned its oldest positions
    CHECK(kvtest::refused_with(h.seq_rm(0, 10, -1), errc::unsupported));
    CHECK(h.seq_pos_max(0) == 19);
    CHECK(h.recurrent().seq_pos_max(0) == 19);
    REQUIRE(h.seq_rm(0, -1, -1));
    CHECK(h.seq_pos_max(0) == -1);
    CHECK(h.recurrent().ssm_state(1, 0)[2] == 0.0f);
}

TEST_CASE("hybrid state files: round trips, bad bytes, a bad part refused with both parts unchanged") {
    const model_shape ash = rec_hyb_attn_shape(2, 12);
    const recurrent_shape rsh = rec_test_shape(2);
    rec_hyb h(ash, rsh, rec_hyb_layers);
    const std::vector<pos_t> pos = {0, 1, 2, 4, 5};
    const std::vector<seq_id_t> sq = {0, 0, 0, 1, 1};
    auto p = h.place(pos, sq).value();
    std::vector<float> rows(pos.size() * 4);
    for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i) * 0.5f;
    for (std::uint32_t l : {0u, 2u}) {
        h.write_k(l, p, rows.data());
        h.write_v(l, p, rows.data());
    }
    rec_engine_run(h.recurrent_for_update(kvcache::detail::internal_access{}), p.recurrent, pos);
    REQUIRE(h.commit() == tx_result::committed);
    const std::vector<token_t> toks = {7, 8, 9};
    const std::vector<std::byte> whole = io::save_state(h, toks);
    const std::vector<std::byte> one = io::save_seq(h, 1);

    auto same = [](const rec_hyb& x, const rec_hyb& y) {
        CHECK(kvtest::snapshot(x.attention()) == kvtest::snapshot(y.attention()));
        CHECK(io::save_state(x.recurrent()) == io::save_state(y.recurrent()));
    };
    rec_hyb other(ash, rsh, rec_hyb_layers);
    auto r = io::load_state(other, whole);
    REQUIRE(r);
    CHECK(r.value().tokens == toks);
    same(h, other);
    CHECK(io::save_state(other, toks) == whole);
    rec_hyb third(ash, rsh, rec_hyb_layers);
    REQUIRE(io::load_seq(third, 0, one));  // sequence 1 into sequence 0
    CHECK(third.seq_pos_min(0) == 4);
    CHECK(third.recurrent().seq_pos_max(0) == 5);
    CHECK(third.recurrent().take_checkpoint(0).state == h.recurrent().take_checkpoint(1).state);
    CHECK(third.seq_pos_max(1) == -1);

    // Every truncation and bit flip is refused, nothing changed.
    rec_hyb target(ash, rsh, rec_hyb_layers);
    REQUIRE(io::load_seq(target, 1, one));
    const auto t_attn = kvtest::snapshot(target.attention());
    const auto t_rec = io::save_state(target.recurrent());
    auto unchanged = [&] {
        CHECK(kvtest::snapshot(target.attention()) == t_attn);
        CHECK(io::save_state(target.recurrent()) == t_rec);
    };
    for (std::size_t n = 0; n < whole.size(); n += 7) REQUIRE_FALSE(io::load_state(target, std::span(whole).first(n)));
    for (std::size_t i = 0; i < whole.size(); i += 3) {
        std::vector<std::byte> bad = whole;
        bad[i] ^= std::byte{0x01};
        REQUIRE_FALSE(io::load_state(target, bad));
    }
    unchanged();
    CHECK(kvtest::refused_with(io::load_state(target, one), errc::unsupported, "use load_seq"));
    // A memory with another layer pattern, or another recurrent shape: shape_mismatch, both parts unchanged.
    rec_hyb swapped(ash, rsh, {true, false, true, false});
    CHECK(kvtest::refused_with(io::load_state(swapped, whole), errc::shape_mismatch, "layer pattern"));
    recurrent_shape rsh2 = rsh;
    rsh2.ssm_size = 5;
    rec_hyb other_rec(ash, rsh2, rec_hyb_layers);
    const std::vector<pos_t> p0 = {3};
    const std::vector<seq_id_t> s0 = {0};
    REQUIRE(other_rec.place(p0, s0));  // something in the attention part
    REQUIRE(other_rec.commit() == tx_result::committed);
    const auto o_attn = kvtest::snapshot(other_rec.attention());
    CHECK(kvtest::refused_with(io::load_state(other_rec, whole), errc::shape_mismatch, "ssm_size"));
    CHECK(kvtest::snapshot(other_rec.attention()) == o_attn);
    // The attention part refuses (it holds more cells than this cache), the recurrent part is kept.
    rec_hyb small(rec_hyb_attn_shape(2, 4), rsh, rec_hyb_layers);
    REQUIRE(io::load_seq(small, 1, io::save_seq(target, 1)));
    const auto s_rec = io::save_state(small.recurrent());
    CHECK(kvtest::refused_with(io::load_state(small, whole), errc::no_space));
    CHECK(io::save_state(small.recurrent()) == s_rec);
    CHECK(small.seq_pos_max(0) == -1);
    CHECK_THROWS_AS((void)io::load_seq(small, 2, one), kvcache::error);
}

TEST_CASE("ops on recurrent and hybrid memories: memory report, the attention part's K-shift") {
    const recurrent_shape rsh = rec_test_shape(3);
    recurrent_memory m(rsh);
    const std::size_t per_seq = rsh.seq_floats() * sizeof(float);
    CHECK(ops::memory(m).reserved_bytes == 3 * per_seq);
    CHECK(ops::memory(m).used_bytes == 0);
    const std::vector<pos_t> pos = {0, 1, 5};
    const std::vector<seq_id_t> sq = {0, 0, 2};
    REQUIRE(m.place(pos, sq));
    REQUIRE(m.commit() == tx_result::committed);
    CHECK(ops::memory(m).used_bytes == 2 * per_seq);
    CHECK(ops::memory(m).held_bytes == 2 * per_seq);

    const model_shape ash = rec_hyb_attn_shape(3);
    rec_hyb h(ash, rsh, rec_hyb_layers);
    kv_cache<f32> a(ash);  // the same operations on a plain cache
    auto ph = h.place(pos, sq).value();
    auto pa = a.place(pos, sq).value();
    std::vector<float> rows(pos.size() * 4);
    for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 5) - 1.5f;
    h.write_k(0, ph, rows.data());
    a.write_k(0, pa.cells, rows.data());
    REQUIRE(h.commit() == tx_result::committed);
    REQUIRE(a.commit() == tx_result::committed);
    const ops::memory_usage u = ops::memory(h), ua = ops::memory(a);
    CHECK(u.reserved_bytes == ua.reserved_bytes + 3 * per_seq);
    CHECK(u.used_bytes == ua.used_bytes + 2 * per_seq);
    REQUIRE(h.seq_add(0, -1, -1, 7));
    REQUIRE(a.seq_add(0, -1, -1, 7));
    CHECK(h.has_shift());
    ops::apply_k_shift(h);
    ops::apply_k_shift(a);
    CHECK_FALSE(h.has_shift());
    CHECK(kvtest::snapshot(h.attention()) == kvtest::snapshot(a));
    CHECK(h.recurrent().seq_pos_min(0) == 7);
}

TEST_CASE("hybrid state files: parts that hold different positions are refused, both parts unchanged") {
    // Found by the state fuzzer (tests/fuzz/regressions/hybrid_parts_disagree_on_positions):
    // a hybrid state whose attention and recurrent parts were each valid but disagreed was
    // accepted, and the memory's two parts then held different positions.
    const recurrent_shape rsh = rec_test_shape(2);
    auto filled = [&](pos_t last0) {
        rec_hyb x(rec_hyb_attn_shape(2, 12), rsh, rec_hyb_layers);
        std::vector<pos_t> pos = {4, 5};
        std::vector<seq_id_t> sq = {1, 1};
        for (pos_t q = 0; q <= last0; ++q) {
            pos.push_back(q);
            sq.push_back(0);
        }
        REQUIRE(x.place(pos, sq));
        x.ssm_state(1, 0)[0] = static_cast<float>(last0);
        REQUIRE(x.commit() == tx_result::committed);
        return x;
    };
    const rec_hyb h = filled(2), longer = filled(3);
    const rec_hyb empty(rec_hyb_attn_shape(2, 12), rsh, rec_hyb_layers);
    using io::detail::write_hybrid;
    rec_hyb target = filled(2);
    REQUIRE(target.seq_rm(1, -1, -1));
    const auto t_attn = kvtest::snapshot(target.attention());
    const auto t_rec = io::save_state(target.recurrent());
    auto unchanged = [&] {
        CHECK(kvtest::snapshot(target.attention()) == t_attn);
        CHECK(io::save_state(target.recurrent()) == t_rec);
    };
    const auto whole = io::state_kind::whole_cache, one = io::state_kind::one_sequence;
    CHECK(kvtest::refused_with(
        io::load_state(target, write_hybrid(h, whole, io::save_state(h.attention()), io::save_state(longer.recurrent()))),
        errc::invalid_cell, "sequence 0 holds positions [0, 2] in the attention part but [0, 3] in the recurrent part"));
    unchanged();
    CHECK(kvtest::refused_with(
        io::load_state(target, write_hybrid(h, whole, io::save_state(h.attention()), io::save_state(empty.recurrent()))),
        errc::invalid_cell, "[0, 2] in the attention part but none"));
    unchanged();
    CHECK(kvtest::refused_with(io::load_seq(target, 1, write_hybrid(h, one, io::save_seq(h.attention(), 1),
                                                                     io::save_seq(longer.recurrent(), 0))),
                               errc::invalid_cell, "sequence 1 holds positions [4, 5] in the attention part but [0, 3]"));
    unchanged();
    // Parts that agree load (the envelope written by hand equals save_state's).
    const auto good = write_hybrid(h, whole, io::save_state(h.attention()), io::save_state(h.recurrent()));
    CHECK(good == io::save_state(h));
    REQUIRE(io::load_state(target, good));
    CHECK(kvtest::snapshot(target.attention()) == kvtest::snapshot(h.attention()));

    // Over an ISWA cache: the full-attention part holds every position, the ring pruned its oldest.
    iswa_shape is;
    is.shape = rec_hyb_attn_shape(2, 64);
    is.swa_layers = {true, false};
    is.swa_n_cells = ring<16>::cells_for(2, 8);
    using iswa_hyb = hybrid_memory<iswa_cache<16, f32>>;
    auto iswa_filled = [&](std::size_t n) {
        iswa_hyb x(is, rsh, rec_hyb_layers);
        std::vector<pos_t> pos(n);
        const std::vector<seq_id_t> sq(n, 0);
        for (std::size_t i = 0; i < n; ++i) pos[i] = static_cast<pos_t>(i);
        REQUIRE(x.place(pos, sq));
        REQUIRE(x.commit() == tx_result::committed);
        return x;
    };
    const iswa_hyb a = iswa_filled(20), b = iswa_filled(21);
    iswa_hyb it(is, rsh, rec_hyb_layers);
    REQUIRE(io::load_state(it, io::save_state(a)));
    CHECK(it.seq_pos_max(0) == 19);
    CHECK(it.attention().window_pos_min(0) > 0);
    CHECK(it.recurrent().seq_pos_min(0) == 0);
    const auto i_attn = io::save_state(it.attention());
    CHECK(kvtest::refused_with(
        io::load_state(it, write_hybrid(a, whole, io::save_state(a.attention()), io::save_state(b.recurrent()))),
        errc::invalid_cell, "[0, 19] in the attention part but [0, 20]"));
    CHECK(io::save_state(it.attention()) == i_attn);
    CHECK(it.recurrent().seq_pos_max(0) == 19);
}
