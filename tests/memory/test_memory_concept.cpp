// The memory contract (memory/memory.hpp): a minimal conforming memory type, the
// concept checks of every kv_cache layout and of iswa_cache, and one test per entry
// point that the ISWA cache works with it (attention per part, K-shift, context shift,
// Self-Extend, memory report, state files, reuse plans, slots with SWA checkpoints,
// the prompt cache's state_store, transactions).
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/prompt/state_store.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>
#include <vector>

#include "iswa_test_util.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvcache;

// ---------------------------------------------------------------------------
// Minimal conforming type: a memory that only keeps (position, sequence) pairs, e.g. the
// bookkeeping of a memory whose tensors live elsewhere. Every member of the concept,
// nothing else.
class positions_memory {
public:
    using memory_concept = memory_tag;   // 1. opt in by name
    using placement_type = placement;    // 2. where a micro-batch went
    static constexpr bool can_shift = true;  // 5. positions may move

    explicit positions_memory(std::uint32_t n_seq) : n_seq_(n_seq) {}

    result<placement> place(std::span<const pos_t> pos, std::span<const seq_id_t> seq) {
        placement p;
        for (std::size_t i = 0; i < pos.size(); ++i) {
            p.cells.push_back(static_cast<std::uint32_t>(items_.size() + staged_.size()));
            staged_.push_back({pos[i], seq[i], 0});
        }
        return p;
    }
    tx_result commit() {
        if (staged_.empty()) return tx_result::nothing_staged;
        items_.insert(items_.end(), staged_.begin(), staged_.end());
        staged_.clear();
        return tx_result::committed;
    }
    tx_result restore() {
        if (staged_.empty()) return tx_result::nothing_staged;
        staged_.clear();
        return tx_result::restored;
    }
    bool in_transaction() const { return !staged_.empty(); }

    void seq_rm(seq_id_t s, pos_t p0, pos_t p1) {
        std::erase_if(items_, [&](const item& x) { return match(x, s, p0, p1); });
    }
    void seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
        const auto n = items_.size();
        for (std::size_t i = 0; i < n; ++i)
            if (match(items_[i], src, p0, p1)) items_.push_back({items_[i].pos, dst, items_[i].shift});
    }
    void seq_keep(seq_id_t s) {
        std::erase_if(items_, [&](const item& x) { return x.seq != s; });
    }
    void seq_add(seq_id_t s, pos_t p0, pos_t p1, pos_t d) {
        for (auto& x : items_)
            if (match(x, s, p0, p1)) x.pos += d, x.shift += d;
    }
    void seq_div(seq_id_t s, pos_t p0, pos_t p1, int d) {
        for (auto& x : items_)
            if (match(x, s, p0, p1)) {
                const pos_t np = x.pos / d;
                x.shift += np - x.pos;
                x.pos = np;
            }
    }
    void clear() { items_.clear(), staged_.clear(); }

    pos_t seq_pos_min(seq_id_t s) const { return extreme(s, true); }
    pos_t seq_pos_max(seq_id_t s) const { return extreme(s, false); }
    std::uint32_t n_seq_max() const { return n_seq_; }
    std::uint32_t n_layer() const { return 0; }
    bool has_shift() const {
        return std::any_of(items_.begin(), items_.end(), [](const item& x) { return x.shift != 0; });
    }
    std::size_t total_bytes() const { return items_.capacity() * sizeof(item); }

private:
    struct item {
        pos_t pos;
        seq_id_t seq;
        pos_t shift;
    };
    static bool match(const item& x, seq_id_t s, pos_t p0, pos_t p1) {
        return (s < 0 || x.seq == s) && (p0 < 0 || x.pos >= p0) && (p1 < 0 || x.pos < p1);
    }
    pos_t extreme(seq_id_t s, bool lo) const {
        pos_t r = -1;
        for (const auto& x : items_)
            if (x.seq == s && (r < 0 || (lo ? x.pos < r : x.pos > r))) r = x.pos;
        return r;
    }
    std::uint32_t n_seq_;
    std::vector<item> items_, staged_;
};

static_assert(kvcache::memory<positions_memory>);
static_assert(!kv_memory<positions_memory>);
static_assert(!composite_memory<positions_memory>);

// Every kv_cache layout and the ISWA cache satisfy the contract.
static_assert(kvcache::memory<kv_cache<>>);
static_assert(kv_memory<kv_cache<f16, contiguous<>>>);
static_assert(kv_memory<kv_cache<f32, paged<32>>>);
static_assert(kv_memory<kv_cache<f16, ring<16>>>);
static_assert(kv_memory<kv_cache<bf16, contiguous<>, reuse::lcp>>);
static_assert(kvcache::memory<iswa_cache<16>>);
static_assert(composite_memory<iswa_cache<16, f32>>);
static_assert(composite_memory<iswa_cache<32, f16, paged<32>, reuse::lcp>>);
static_assert(!kv_memory<iswa_cache<16>>);
static_assert(!kvcache::memory<int>);

using kvtest::iswa16;
using iswa_lcp = iswa_cache<kvtest::iswa_w, f32, reuse::lcp>;

}  // namespace

TEST_CASE("memory: the minimal conforming type works with transaction<M>") {
    positions_memory m(2);
    const pos_t pos[] = {0, 1, 2};
    const seq_id_t seq[] = {0, 0, 0};
    {
        transaction tx(m);
        REQUIRE(m.place(pos, seq).ok());
        CHECK(m.in_transaction());
    }  // restored
    CHECK(m.seq_pos_max(0) == -1);
    transaction tx(m);
    REQUIRE(m.place(pos, seq).ok());
    CHECK(tx.commit() == tx_result::committed);
    m.seq_add(0, 1, -1, 5);
    CHECK(m.seq_pos_max(0) == 7);
    CHECK(m.has_shift());
}

TEST_CASE("memory: iswa_cache with transaction<M>") {
    iswa16 c(kvtest::iswa_test_shape());
    const pos_t pos[] = {0, 1};
    const seq_id_t seq[] = {0, 0};
    {
        transaction tx(c);
        REQUIRE(c.place(pos, seq).ok());
    }
    CHECK(c.seq_pos_max(0) == -1);
    CHECK(c.swa().used() == 0);
}

TEST_CASE("memory: iswa_cache with ops::attention (per part) and ops::apply_k_shift") {
    iswa16 c(kvtest::iswa_test_shape());
    std::mt19937 rng(11);
    kvtest::iswa_fill(c, 0, 0, 12, rng);  // within the window: the ring can move every position
    REQUIRE(c.seq_add(0, 0, -1, 3));
    CHECK(c.has_shift());
    ops::apply_k_shift(c);
    CHECK_FALSE(c.has_shift());
    ops::attention_workspace ws;
    ops::attention_params ap;
    ap.n_head = 2;
    std::vector<float> q(2 * 8, 0.5f), out(2 * 8);
    const pos_t qp = c.seq_pos_max(0);
    const seq_id_t s = 0;
    ap.window = static_cast<std::int32_t>(kvtest::iswa_w);
    ops::attention(c.swa(), 0, q.data(), &qp, &s, 1, ap, out.data(), ws);
    for (float x : out) CHECK(std::isfinite(x));
    ap.window = 0;
    ops::attention(c.full(), 0, q.data(), &qp, &s, 1, ap, out.data(), ws);
    for (float x : out) CHECK(std::isfinite(x));
}

TEST_CASE("memory: iswa_cache with ops::context_shift, ops::self_extend and ops::memory") {
    iswa16 c(kvtest::iswa_test_shape());
    std::mt19937 rng(12);
    kvtest::iswa_fill(c, 0, 0, 12, rng);
    CHECK(ops::context_shift(c, 0, 2, 2).value().n_past_after == 10);
    CHECK(c.swa().seq_pos_max(0) == 9);
    ops::self_extend_state st{2, 8, 0};
    CHECK(ops::self_extend(c, 0, st, 10).value() == 6);
    CHECK(kvtest::positions_of(c.full(), 0) == kvtest::positions_of(c.swa(), 0));
    CHECK(ops::memory(c).reserved_bytes == c.total_bytes());
}

TEST_CASE("memory: iswa_cache with io:: state functions") {
    iswa16 a(kvtest::iswa_test_shape()), b(kvtest::iswa_test_shape());
    std::mt19937 rng(13);
    kvtest::iswa_fill(a, 0, 0, 30, rng);
    auto r = io::load_state(b, io::save_state(a));
    REQUIRE(r.ok());
    auto r1 = io::load_seq(b, 1, io::save_seq(a, 0));
    REQUIRE(r1.ok());
    CHECK(b.seq_pos_max(1) == 29);
    CHECK(b.swa().seq_pos_min(1) == a.swa().seq_pos_min(0));
}

TEST_CASE("memory: iswa_cache with reuse::apply_plan") {
    iswa16 c(kvtest::iswa_test_shape());
    std::mt19937 rng(14);
    kvtest::iswa_fill(c, 0, 0, 12, rng);
    reuse::plan p;
    p.n_request = 20;
    p.n_lcp = p.n_past = 8;
    REQUIRE(reuse::apply_plan(c, 0, p));
    CHECK(c.full().seq_pos_max(0) == 7);
    CHECK(c.swa().seq_pos_max(0) == 7);
    // A truncation the ring refuses (its window pruned what the next token needs): both unchanged.
    kvtest::iswa_fill(c, 1, 0, 40, rng);
    const auto before = kvtest::iswa_snap(c);
    p.n_lcp = p.n_past = 20;
    CHECK(kvtest::refused_result(reuse::apply_plan(c, 1, p), "unsupported"));
    CHECK(kvtest::iswa_snap(c) == before);
    CHECK_THROWS_AS(static_cast<void>(reuse::apply_plan(c, 2, p)), kvcache::error);  // seq out of range
}

TEST_CASE("memory: slot_manager over iswa_cache reuses a shared prefix (reuse::lcp)") {
    iswa_lcp c(kvtest::iswa_test_shape());
    slot_manager slots(c, {.n_slots = 1});
    std::mt19937 rng(15);
    prompt_tokens a;
    for (token_t t = 0; t < 12; ++t) a.push_back(100 + t);
    auto p = slots.prepare(a).value();
    CHECK(p.n_past == 0);
    kvtest::iswa_fill(c, p.seq, 0, 12, rng);
    slots.commit_prompt(p.slot);
    slots.release(p.slot);
    prompt_tokens b;
    for (token_t t = 0; t < 10; ++t) b.push_back(100 + t);
    for (token_t t = 0; t < 4; ++t) b.push_back(900 + t);
    auto q = slots.prepare(b).value();
    CHECK(q.n_past == 10);
    CHECK(q.metrics.from_slot == 10);
    CHECK_FALSE(q.metrics.checkpoint_restored);
    CHECK(c.full().seq_pos_max(q.seq) == 9);
    CHECK(c.swa().seq_pos_max(q.seq) == 9);
    kvtest::iswa_fill(c, q.seq, 10, 4, rng);
    slots.commit_prompt(q.slot);
    slots.release(q.slot);
    // n_swa other than the ISWA window is refused.
    CHECK_THROWS_AS((slot_manager<iswa_lcp>(c, {.n_slots = 1, .n_swa = 8})), kvcache::error);
}

TEST_CASE("memory: slot_manager over iswa_cache restores the sliding-window part from a checkpoint (F23)") {
    iswa_lcp c(kvtest::iswa_test_shape());
    slot_manager slots(c, {.n_slots = 1});
    std::mt19937 rng(16);
    prompt_tokens a;
    for (token_t t = 0; t < 40; ++t) a.push_back(100 + t);
    auto p = slots.prepare(a).value();
    kvtest::iswa_fill(c, p.seq, 0, 24, rng);
    REQUIRE(slots.save_checkpoint(p.slot));  // at 24 tokens: the ring holds the window the 25th needs
    CHECK(slots.n_checkpoints(p.slot) == 1);
    kvtest::iswa_fill(c, p.seq, 24, 16, rng);
    slots.commit_prompt(p.slot);
    slots.release(p.slot);
    CHECK(c.swa().seq_pos_min(p.seq) > 30 - static_cast<pos_t>(kvtest::iswa_w));  // the window moved on
    // A request sharing 30 tokens: the ring no longer holds the window of position 30,
    // so the slot continues from the checkpoint at 24 (full part too).
    prompt_tokens b;
    for (token_t t = 0; t < 30; ++t) b.push_back(100 + t);
    for (token_t t = 0; t < 6; ++t) b.push_back(900 + t);
    auto q = slots.prepare(b).value();
    CHECK(q.metrics.checkpoint_restored);
    CHECK(q.n_past == 24);
    CHECK(c.full().seq_pos_max(q.seq) == 23);
    CHECK(c.swa().seq_pos_max(q.seq) == 23);
    CHECK(c.swa().seq_pos_min(q.seq) <= 24 - static_cast<pos_t>(kvtest::iswa_w));
    kvtest::iswa_fill(c, q.seq, 24, 12, rng);
    slots.commit_prompt(q.slot);
    slots.release(q.slot);
    // A request sharing 30 tokens without a checkpoint below: everything is recomputed.
    slots.clear_slot(0);
    auto r = slots.prepare(a).value();
    kvtest::iswa_fill(c, r.seq, 0, 40, rng);
    slots.commit_prompt(r.slot);
    slots.release(r.slot);
    auto s = slots.prepare(b).value();
    CHECK(s.n_past == 0);
    CHECK_FALSE(s.metrics.checkpoint_restored);
    CHECK(c.full().seq_pos_max(s.seq) == -1);
    CHECK(c.swa().seq_pos_max(s.seq) == -1);
}

TEST_CASE("memory: iswa_cache with state_store (prompt cache entries)") {
    iswa16 c(kvtest::iswa_test_shape());
    std::mt19937 rng(17);
    kvtest::iswa_fill(c, 0, 0, 20, rng);
    state_store<iswa16> st;
    auto h = st.save(c, 0);
    REQUIRE(h.ok());
    CHECK(st.bytes(c, h.value()) == io::seq_state_size(c, 0));
    REQUIRE(st.load(c, 1, h.value()).ok());
    CHECK(kvtest::positions_of(c.full(), 1) == kvtest::positions_of(c.full(), 0));
    CHECK(kvtest::positions_of(c.swa(), 1) == kvtest::positions_of(c.swa(), 0));
}
