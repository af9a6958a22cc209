// cell_table: the incrementally maintained indexes (used set, first/last used cell,
// per-sequence position multiset, shifted-cell count) agree with a recomputation
// from the raw arrays after every random mutation; snapshots restore exactly; rollback
// points (cell_table::mark) put back everything their changes touched.
#include <doctest/doctest.h>

#include <kvcache/cells/cell_table.hpp>

#include <map>
#include <random>
#include <vector>

namespace {

using kvcache::pos_t;
using kvcache::seq_id_t;

void check_indexes(const kvcache::cell_table& t) {
    std::uint32_t used = 0, shifted = 0;
    std::int64_t first = -1, last = -1;
    std::vector<std::map<pos_t, std::uint32_t>> per_seq(t.n_seq_max());
    for (std::uint32_t c = 0; c < t.size(); ++c) {
        if (t.is_free(c)) {
            REQUIRE(t.seqs(c).none());
            REQUIRE(t.shift(c) == 0);
            continue;
        }
        REQUIRE(t.seqs(c).any());
        ++used;
        if (first < 0) first = c;
        last = c;
        shifted += t.shift(c) != 0;
        t.seqs(c).for_each([&](seq_id_t s) { ++per_seq[static_cast<std::size_t>(s)][t.pos(c)]; });
    }
    REQUIRE(t.used() == used);
    REQUIRE(t.free_count() == t.size() - used);
    REQUIRE(t.n_shifted() == shifted);
    if (used > 0) {
        REQUIRE(t.first_used() == first);
        REQUIRE(t.last_used() == last);
    }
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(t.n_seq_max()); ++s) {
        const auto& m = per_seq[static_cast<std::size_t>(s)];
        REQUIRE(t.seq_positions(s) == m);
        REQUIRE(t.seq_pos_min(s) == (m.empty() ? -1 : m.begin()->first));
        REQUIRE(t.seq_pos_max(s) == (m.empty() ? -1 : m.rbegin()->first));
    }
}

/// One random mutation (every kind of change, every kind the journal records).
void random_mutation(kvcache::cell_table& t, std::mt19937& rng) {
    auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const auto c = static_cast<std::uint32_t>(uni(0, static_cast<int>(t.size()) - 1));
    const seq_id_t s = uni(0, static_cast<int>(t.n_seq_max()) - 1);
    switch (uni(0, 9)) {
        case 0:
        case 1:
            if (t.is_free(c)) {
                kvcache::seq_set set = kvcache::seq_set::of(s);
                if (uni(0, 3) == 0) set.set(uni(0, static_cast<int>(t.n_seq_max()) - 1));
                const kvcache::mrope_pos e = t.has_ext() ? kvcache::mrope_pos{uni(0, 9), uni(0, 9), uni(0, 9)}
                                                         : kvcache::mrope_pos{};
                t.occupy(c, uni(0, 30), set, e);
                if (uni(0, 2) == 0) t.set_shift(c, uni(-5, 5));
            }
            break;
        case 2:
            if (!t.is_free(c)) t.add_seq(c, s);
            break;
        case 3:
            if (!t.is_free(c) && t.seqs(c).test(s)) t.rm_seq(c, s);
            break;
        case 4:
        case 5:
            if (!t.is_free(c)) t.move_pos(c, uni(0, 40));
            break;
        case 6: {  // free_cell, then maybe the saved state back (load)
            if (t.is_free(c)) break;
            const auto snap = t.save(c);
            t.free_cell(c);
            if (uni(0, 1) == 1) t.load(c, snap);
            if (!t.is_free(c)) REQUIRE(t.pos(c) == snap.pos);
            break;
        }
        case 7:
            if (!t.is_free(c)) {
                t.reserve_journal(1);
                t.set_shift(c, uni(-9, 9));
            }
            break;
        case 8:
            if (uni(0, 10) == 0) {
                t.reserve_clear_shifts();
                t.clear_shifts();
            }
            break;
        default:
            if (uni(0, 60) == 0) t.clear();
    }
}

}  // namespace

TEST_CASE("seq_set basics") {
    kvcache::seq_set s;
    CHECK(s.none());
    s.set(0);
    s.set(63);
    s.set(64);
    s.set(KVCACHE_MAX_SEQ - 1);
    CHECK(s.count() == 4);
    std::vector<seq_id_t> seen;
    s.for_each([&](seq_id_t q) { seen.push_back(q); });
    CHECK(seen == std::vector<seq_id_t>{0, 63, 64, KVCACHE_MAX_SEQ - 1});
    s.reset(63);
    CHECK_FALSE(s.test(63));
    kvcache::seq_set t = kvcache::seq_set::of(0);
    t.set(64);
    t.set(KVCACHE_MAX_SEQ - 1);
    CHECK(s == t);
    t.reset(64);
    CHECK_FALSE(s == t);
    CHECK(kvcache::seq_set::of(5).test(5));
}

TEST_CASE("cell_table indexes stay consistent under random mutations") {
    std::mt19937 rng(42);
    kvcache::cell_table t(50, 5);
    check_indexes(t);
    for (int step = 0; step < 20000; ++step) {
        random_mutation(t, rng);
        check_indexes(t);
    }
}

TEST_CASE("move_pos accumulates the shift as current minus original position") {
    kvcache::cell_table t(4, 2);
    t.occupy(1, 10, kvcache::seq_set::of(0));
    t.move_pos(1, 15);
    t.move_pos(1, 3);
    CHECK(t.shift(1) == -7);
    CHECK(t.n_shifted() == 1);
    t.move_pos(1, 10);
    CHECK(t.shift(1) == 0);
    CHECK(t.n_shifted() == 0);
}

TEST_CASE("cell_table: the content stamp changes with every change of positions or sequences") {
    kvcache::cell_table t(8, 4);
    std::vector<std::uint64_t> seen{t.stamp()};
    auto changed = [&](const char* what) {
        CAPTURE(what);
        for (auto s : seen) CHECK(t.stamp() != s);  // never a stamp seen before
        seen.push_back(t.stamp());
    };
    t.occupy(0, 5, kvcache::seq_set::of(0));
    changed("occupy");
    t.occupy(1, 6, kvcache::seq_set::of(0));
    changed("occupy");
    t.add_seq(0, 1);
    changed("add_seq");
    const auto s0 = t.stamp();
    t.add_seq(0, 1);  // already there: nothing changes
    CHECK(t.stamp() == s0);
    t.move_pos(1, 6);  // same position: nothing changes
    CHECK(t.stamp() == s0);
    t.set_shift(1, 3);  // pending shifts are not part of the stamped content
    CHECK(t.stamp() == s0);
    t.move_pos(1, 9);
    changed("move_pos");
    t.rm_seq(0, 1);
    changed("rm_seq");
    const auto snap = t.save(1);
    t.free_cell(1);
    changed("free_cell");
    t.load(1, snap);
    changed("load");
    kvcache::cell_table copy = t;  // same content, same stamp
    CHECK(copy.stamp() == t.stamp());
    kvcache::cell_table moved = std::move(copy);
    CHECK(moved.stamp() == t.stamp());
    CHECK(copy.stamp() != t.stamp());  // NOLINT(bugprone-use-after-move): its content is gone
    t.clear();
    changed("clear");
    kvcache::cell_table other(8, 4);
    for (auto s : seen) CHECK(other.stamp() != s);  // unique across tables
}

namespace {

/// Everything a rollback must put back: arrays, indexes, stamps, generations.
struct table_state {
    std::vector<pos_t> pos;
    std::vector<std::int32_t> shift;
    std::vector<kvcache::seq_set> seqs;
    std::vector<kvcache::mrope_pos> ext;
    std::vector<std::uint32_t> used;
    std::vector<std::map<pos_t, std::uint32_t>> seq_pos;
    std::vector<std::uint64_t> gen;
    std::uint32_t n_shifted = 0;
    std::uint64_t stamp = 0;
    friend bool operator==(const table_state&, const table_state&) = default;
};

table_state state_of(const kvcache::cell_table& t) {
    table_state st;
    for (std::uint32_t c = 0; c < t.size(); ++c) {
        st.pos.push_back(t.pos(c));
        st.shift.push_back(t.shift(c));
        st.seqs.push_back(t.seqs(c));
        st.ext.push_back(t.ext(c));
    }
    st.used.assign(t.used_cells().begin(), t.used_cells().end());
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(t.n_seq_max()); ++s) {
        st.seq_pos.push_back(t.seq_positions(s));
        st.gen.push_back(t.seq_generation(s));
    }
    st.n_shifted = t.n_shifted();
    st.stamp = t.stamp();
    return st;
}

}  // namespace

TEST_CASE("cell_table rollback points: nested marks put back every array, index, stamp and generation") {
    for (const bool with_ext : {false, true}) {
        std::mt19937 rng(with_ext ? 7 : 3);
        auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
        kvcache::cell_table t(40, 4, with_ext);
        struct level {
            kvcache::cell_table::mark m;
            table_state at;
        };
        std::vector<level> marks;  // innermost last
        int rollbacks = 0, deep = 0;
        for (int step = 0; step < 30000; ++step) {
            const int r = uni(0, 99);
            if (r < 8 && marks.size() < 5) {  // a new innermost mark
                marks.emplace_back();
                marks.back().at = state_of(t);
                t.save_mark(marks.back().m);
                CHECK(t.live_marks() == marks.size());
            } else if (r < 12 && !marks.empty()) {  // roll back some mark; the newer ones are void
                const auto k = static_cast<std::size_t>(uni(0, static_cast<int>(marks.size()) - 1));
                const std::size_t before = marks.size();
                t.rollback(marks[k].m);
                REQUIRE(state_of(t) == marks[k].at);
                check_indexes(t);
                for (std::size_t i = marks.size(); i-- > k + 1;) t.release(marks[i].m);
                marks.resize(k + 1);
                ++rollbacks;
                deep += k + 1 < before;
            } else if (r < 15 && !marks.empty()) {  // release one, possibly out of order
                const auto k = static_cast<std::size_t>(uni(0, static_cast<int>(marks.size()) - 1));
                t.release(marks[k].m);
                marks.erase(marks.begin() + static_cast<std::ptrdiff_t>(k));
                CHECK(t.live_marks() == marks.size());
            } else {
                random_mutation(t, rng);
            }
        }
        for (auto& l : marks) t.release(l.m);
        CHECK(t.live_marks() == 0);
        CHECK(rollbacks > 100);
        CHECK(deep > 10);  // rollbacks past newer marks (those then only released)
        check_indexes(t);
    }
}

TEST_CASE("cell_table rollback points: a rollback right after the mark changes nothing; marks survive a move") {
    kvcache::cell_table t(8, 2);
    t.occupy(1, 5, kvcache::seq_set::of(0));
    kvcache::cell_table::mark m;
    t.save_mark(m);
    const table_state before = state_of(t);
    t.rollback(m);
    CHECK(state_of(t) == before);
    t.occupy(2, 6, kvcache::seq_set::of(1));
    t.move_pos(1, 9);
    kvcache::cell_table moved = std::move(t);  // the journal goes along
    CHECK(t.live_marks() == 0);                // NOLINT(bugprone-use-after-move): the moved-from table has none
    moved.rollback(m);
    CHECK(state_of(moved) == before);
    kvcache::cell_table copy = moved;  // a copy has no marks
    CHECK(copy.live_marks() == 0);
    moved.release(m);
    CHECK(moved.live_marks() == 0);
    CHECK_FALSE(m.is_live());
}
