// kvcache: per-cell metadata, shared by all layers (F1), kept apart from K/V data.
//
// Struct of arrays: position, pending K-shift delta and sequence set per cell,
// plus indexes maintained on every change so that the usual queries are O(1) or
// O(log n): used count, first/last used cell, per-sequence position multiset
// (min/max/contains), number of cells with a pending shift. Tables made for M-RoPE
// (with_ext) also keep each cell's extra positions (mrope_pos); the others hold no array for them.
//
// Rollback points (save_mark / rollback / release): while a mark is live every change is
// journaled as its inverse, so a rollback costs what changed since the mark, not the size
// of the table (the memories' checkpoints were whole copies of the table before: a
// place() + restore() of 4 tokens into a contiguous cache of 131,072 used cells took 38 ms
// on a Zen 3, 95% of it copying the std::set / std::map indexes). The index nodes a journaled change removes
// are kept (node handles) and put back by the rollback, which therefore never allocates.
#pragma once

#include <algorithm> // std::max, std::copy
#include <atomic>   // process-wide content stamps
#include <cstdint>  // fixed-width integers
#include <iterator> // std::prev
#include <map>      // per-sequence position multiset
#include <memory>   // observer checkpoints
#include <set>      // ordered used cells
#include <utility>  // std::exchange, std::pair
#include <vector>   // arrays

#include "../config.hpp"
#include "../model_shape.hpp"
#include "seq_set.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Receives every change of cell occupancy and membership, in the order it happens.
/// Layouts with per-block bookkeeping (paged, ring) attach one so that their tables
/// stay incremental whichever path changed the cells (placement, restore, sequence
/// ops, defragmentation, state loading). Callbacks may allocate and so throw
/// std::bad_alloc; the memory then puts the cell table and the observer back from a
/// checkpoint (clone / assign_from / swap_state), so a throw leaves both as they were.
class cell_observer {
public:
    virtual void on_seq_added(std::uint32_t cell, seq_id_t s) = 0;    ///< s now uses cell
    virtual void on_seq_removed(std::uint32_t cell, seq_id_t s) = 0;  ///< s no longer uses cell
    virtual void on_cleared() = 0;                                     ///< every cell is free
    /// A copy of this observer's state (for a checkpoint; may throw, nothing changed).
    [[nodiscard]] virtual std::unique_ptr<cell_observer> clone() const = 0;
    /// Copies the state of `o` (same dynamic type, made by clone) into this one, reusing its memory.
    virtual void assign_from(const cell_observer& o) = 0;
    /// Exchanges the states of this observer and `o` (same dynamic type); never allocates.
    virtual void swap_state(cell_observer& o) noexcept = 0;
    virtual ~cell_observer() = default;

protected:
    cell_observer() = default;
    cell_observer(const cell_observer&) = default;
    cell_observer& operator=(const cell_observer&) = default;
};

namespace detail {
/// The cell table's observer pointer: a copy has no observer and a move takes it
/// along, so only the table inside the cache that owns the observer ever calls it.
struct observer_slot {
    cell_observer* p = nullptr;
    observer_slot() = default;
    observer_slot(const observer_slot&) noexcept {}
    observer_slot(observer_slot&& o) noexcept : p(o.p) { o.p = nullptr; }
    observer_slot& operator=(const observer_slot&) noexcept {
        p = nullptr;
        return *this;
    }
    observer_slot& operator=(observer_slot&& o) noexcept {
        p = o.p;
        o.p = nullptr;
        return *this;
    }
    ~observer_slot() = default;
};

/// Next content stamp: unique in the process (0 is never handed out).
inline std::uint64_t next_cell_stamp() noexcept {
    static std::atomic<std::uint64_t> counter{0};
    return counter.fetch_add(1, std::memory_order_relaxed) + 1;
}

/// The cell table's content stamp: a copy keeps it (same content), a moved-from table
/// gets a fresh one (its content is gone).
struct stamp_slot {
    std::uint64_t v = next_cell_stamp();
    stamp_slot() = default;
    stamp_slot(const stamp_slot&) noexcept = default;
    stamp_slot(stamp_slot&& o) noexcept : v(o.v) { o.v = next_cell_stamp(); }
    stamp_slot& operator=(const stamp_slot&) noexcept = default;
    stamp_slot& operator=(stamp_slot&& o) noexcept {
        v = o.v;
        o.v = next_cell_stamp();
        return *this;
    }
    ~stamp_slot() = default;
};
/// The journal of a cell table (cell_table::mark): a copy starts empty (the marks belong
/// to the table they were saved on), a move takes it along.
template <class Journal>
struct journal_slot {
    Journal j;
    journal_slot() = default;
    journal_slot(const journal_slot&) {}
    journal_slot(journal_slot&& o) noexcept : j(std::move(o.j)) { o.j.marks = 0; }
    journal_slot& operator=(const journal_slot&) {
        j = Journal{};
        return *this;
    }
    journal_slot& operator=(journal_slot&& o) noexcept {
        j = std::move(o.j);
        o.j.marks = 0;
        return *this;
    }
    ~journal_slot() = default;
};
}  // namespace detail

class cell_table {
public:
    /// Saved state of one cell (transactions restore it exactly).
    struct snapshot {
        pos_t pos = -1;
        std::int32_t shift = 0;
        seq_set seqs{};
        mrope_pos ext{};  ///< M-RoPE tables only (else zero)
    };

    /// A rollback point (save_mark). Move-only; a moved-from mark is not live.
    struct mark {
        mark() = default;
        mark(const mark&) = delete;
        mark& operator=(const mark&) = delete;
        mark(mark&& o) noexcept
            : at(o.at), stamp(o.stamp), n_shifted(o.n_shifted), seq_gen(std::move(o.seq_gen)),
              live(std::exchange(o.live, false)) {}
        mark& operator=(mark&& o) noexcept {
            at = o.at;
            stamp = o.stamp;
            n_shifted = o.n_shifted;
            seq_gen = std::move(o.seq_gen);
            live = std::exchange(o.live, false);
            return *this;
        }
        ~mark() = default;
        /// Whether the mark was saved and not released.
        [[nodiscard]] bool is_live() const noexcept { return live; }

    private:
        friend class cell_table;
        std::size_t at = 0;                 // journal length when saved
        std::uint64_t stamp = 0;            // content stamp then
        std::uint32_t n_shifted = 0;        // cells with a pending shift then
        std::vector<std::uint64_t> seq_gen;  // sequence generations then
        bool live = false;
    };

    /// with_ext: keep M-RoPE extra positions per cell (rope_params::mrope on).
    cell_table(std::uint32_t n_cells, std::uint32_t n_seq_max, bool with_ext = false)
        : pos_(n_cells, -1), shift_(n_cells, 0), seqs_(n_cells), seq_pos_(n_seq_max), seq_gen_(n_seq_max, 0) {
        if (with_ext) ext_.resize(n_cells);
    }

    [[nodiscard]] std::uint32_t size() const noexcept { return static_cast<std::uint32_t>(pos_.size()); }
    [[nodiscard]] std::uint32_t n_seq_max() const noexcept { return static_cast<std::uint32_t>(seq_pos_.size()); }
    /// Number of occupied cells.
    [[nodiscard]] std::uint32_t used() const noexcept { return static_cast<std::uint32_t>(used_.size()); }
    [[nodiscard]] std::uint32_t free_count() const noexcept { return size() - used(); }
    [[nodiscard]] bool is_free(std::uint32_t c) const noexcept { return pos_[c] < 0; }
    [[nodiscard]] pos_t pos(std::uint32_t c) const noexcept { return pos_[c]; }
    /// Pending RoPE delta of the cell's K: current position minus the position K was computed at.
    [[nodiscard]] std::int32_t shift(std::uint32_t c) const noexcept { return shift_[c]; }
    [[nodiscard]] const seq_set& seqs(std::uint32_t c) const noexcept { return seqs_[c]; }
    /// Whether the table keeps M-RoPE extra positions.
    [[nodiscard]] bool has_ext() const noexcept { return !ext_.empty(); }
    /// M-RoPE extra positions of cell c (zero when free or when the table keeps none). They
    /// never move: seq_add / seq_div move the temporal position only.
    [[nodiscard]] mrope_pos ext(std::uint32_t c) const noexcept { return ext_.empty() ? mrope_pos{} : ext_[c]; }
    /// Lowest occupied cell. Call only if used() > 0.
    [[nodiscard]] std::uint32_t first_used() const noexcept {
        KVCACHE_ASSERT(!used_.empty());
        return *used_.begin();
    }
    /// Highest occupied cell. Call only if used() > 0.
    [[nodiscard]] std::uint32_t last_used() const noexcept {
        KVCACHE_ASSERT(!used_.empty());
        return *used_.rbegin();
    }
    /// Occupied cells in increasing order.
    [[nodiscard]] const std::set<std::uint32_t>& used_cells() const noexcept { return used_; }
    /// Calls f(c) for every occupied cell, in increasing order: a scan of the positions array
    /// between the first and the last occupied cell, several times faster than walking
    /// used_cells()'s tree (131,072 cells, Zen 3: ~7 ms for the tree).
    template <class F>
    void for_each_used(F&& f) const {
        if (used_.empty()) return;
        const std::uint32_t last = last_used();
        for (std::uint32_t c = first_used(); c <= last; ++c)
            if (pos_[c] >= 0) f(c);
    }
    /// Whether sequence s holds a position in [lo, hi). s must be valid.
    [[nodiscard]] bool seq_has_pos_in(seq_id_t s, std::int64_t lo, std::int64_t hi) const noexcept {
        const auto& m = seq_pos_[static_cast<std::size_t>(s)];
        if (m.empty() || hi <= lo) return false;
        auto it = lo <= m.begin()->first ? m.begin() : m.lower_bound(static_cast<pos_t>(lo));
        return it != m.end() && it->first < hi;
    }
    /// Number of cells with a pending K-shift.
    [[nodiscard]] std::uint32_t n_shifted() const noexcept { return n_shifted_; }

    /// Smallest position of sequence s, or -1 if it has no cells. s must be valid.
    [[nodiscard]] pos_t seq_pos_min(seq_id_t s) const noexcept {
        const auto& m = seq_pos_[static_cast<std::size_t>(s)];
        return m.empty() ? -1 : m.begin()->first;
    }
    /// Largest position of sequence s, or -1 if it has no cells. s must be valid.
    [[nodiscard]] pos_t seq_pos_max(seq_id_t s) const noexcept {
        const auto& m = seq_pos_[static_cast<std::size_t>(s)];
        return m.empty() ? -1 : m.rbegin()->first;
    }
    /// Number of cells used by sequence s.
    [[nodiscard]] std::uint32_t seq_cell_count(seq_id_t s) const noexcept {
        std::uint32_t n = 0;
        for (const auto& [p, c] : seq_pos_[static_cast<std::size_t>(s)]) n += c;
        return n;
    }
    /// Whether sequence s holds position p in some cell.
    [[nodiscard]] bool seq_has_pos(seq_id_t s, pos_t p) const noexcept {
        return seq_pos_[static_cast<std::size_t>(s)].count(p) != 0;
    }
    /// Position multiset of sequence s (position -> number of cells).
    [[nodiscard]] const std::map<pos_t, std::uint32_t>& seq_positions(seq_id_t s) const noexcept {
        return seq_pos_[static_cast<std::size_t>(s)];
    }

    /// Raw arrays for kernels (size() entries each).
    [[nodiscard]] const pos_t* pos_data() const noexcept { return pos_.data(); }
    [[nodiscard]] const std::int32_t* shift_data() const noexcept { return shift_.data(); }
    [[nodiscard]] const seq_set* seq_data() const noexcept { return seqs_.data(); }
    /// Content stamp of the positions and sequence sets (not of the pending shifts): a new
    /// process-wide unique value after every change, so two reads that see the same stamp
    /// saw the same content. Attention keys its per-tile summaries on it and rebuilds them
    /// once per change instead of once per layer.
    [[nodiscard]] std::uint64_t stamp() const noexcept { return stamp_.v; }

    /// Generation of sequence s: the content stamp of the table's last change of the cells
    /// s holds (a cell added to or removed from s, a position of s moved, clear()); 0 if s
    /// never changed. Equal generations mean s still holds the same cells at the same
    /// positions. Prompt-cache entries and slot states record it to detect changes under them.
    [[nodiscard]] std::uint64_t seq_generation(seq_id_t s) const noexcept { return seq_gen_[static_cast<std::size_t>(s)]; }

    // --- mutations (preconditions asserted; the cache validates arguments first) ---
    // Each is complete or, on a throw (std::bad_alloc from an index node or the journal),
    // leaves the table as it was; the observer is told after the table changed (a throw
    // there leaves the table changed: the memories roll back both from a checkpoint).

    /// Occupies free cell c with position p for the sequences in `seqs` (non-empty).
    /// e: the cell's M-RoPE extra positions (ignored, and must be zero, without has_ext()).
    void occupy(std::uint32_t c, pos_t p, const seq_set& seqs, const mrope_pos& e = {}) {
        KVCACHE_ASSERT(is_free(c) && p >= 0 && seqs.any());
        KVCACHE_ASSERT(!ext_.empty() || e == mrope_pos{});
        reserve_journal(2);  // its record and one for a set_shift of the cell
        touch();
        used_.insert(c);
        index_add_all(seqs, p, [&] { used_.erase(c); });
        pos_[c] = p;
        if (!ext_.empty()) ext_[c] = e;
        seqs_[c] = seqs;
        if (recording()) journal_.j.recs.push_back(jrec{jop::occupy, c});
        notify_added(c, seqs);
    }
    /// Adds sequence s to occupied cell c (no-op if already there).
    void add_seq(std::uint32_t c, seq_id_t s) {
        KVCACHE_ASSERT(!is_free(c));
        if (seqs_[c].test(s)) return;
        reserve_journal(1);
        touch();
        ++seq_pos_[static_cast<std::size_t>(s)][pos_[c]];
        seq_gen_[static_cast<std::size_t>(s)] = stamp_.v;
        seqs_[c].set(s);
        if (recording()) journal_.j.recs.push_back(jrec{jop::add_seq, c, s});
        if (obs_.p != nullptr) obs_.p->on_seq_added(c, s);
    }
    /// Removes sequence s from cell c; frees the cell when no sequence is left.
    void rm_seq(std::uint32_t c, seq_id_t s) {
        KVCACHE_ASSERT(!is_free(c) && seqs_[c].test(s));
        reserve_removals(1);
        rm_seq_unchecked(c, s);
        if (obs_.p != nullptr) obs_.p->on_seq_removed(c, s);
    }
    /// Frees cell c, dropping every sequence.
    void free_cell(std::uint32_t c) {
        KVCACHE_ASSERT(!is_free(c));
        const seq_set held = seqs_[c];
        reserve_removals(static_cast<std::uint32_t>(held.count()));
        held.for_each([&](seq_id_t s) { rm_seq_unchecked(c, s); });
        if (obs_.p != nullptr) held.for_each([&](seq_id_t s) { obs_.p->on_seq_removed(c, s); });
    }
    /// Moves cell c to position p >= 0 and accumulates the K-shift delta.
    void move_pos(std::uint32_t c, pos_t p) {
        KVCACHE_ASSERT(!is_free(c) && p >= 0);
        const pos_t old = pos_[c];
        if (p == old) return;
        const seq_set held = seqs_[c];
        reserve_journal(1);
        reserve_nodes(static_cast<std::uint32_t>(held.count()), 0);
        const bool rec = recording();
        touch();
        index_add_all(held, p, [] {});  // the new position first: a throw leaves the old one
        std::uint32_t kept = 0;
        held.for_each([&](seq_id_t s) { kept += index_rm(s, old, rec); });
        if (rec) journal_.j.recs.push_back(jrec{jop::move_pos, c, 0, old, shift_[c], kept});
        set_shift_raw(c, shift_[c] + (p - old));  // fits: both positions in [0, 2^31)
        pos_[c] = p;
    }
    /// Sets the pending shift of cell c (used when a cell's K/V is copied elsewhere). Under a
    /// live mark the change is journaled: std::bad_alloc is possible then, with nothing
    /// changed, except right after an occupy() of the cell (which keeps room for it).
    void set_shift(std::uint32_t c, std::int32_t d) {
        if (shift_[c] == d) return;
        reserve_journal(1);
        if (recording()) journal_.j.recs.push_back(jrec{jop::set_shift, c, 0, 0, shift_[c]});
        set_shift_raw(c, d);
    }
    /// Room in the journal for clear_shifts() under a live mark (may throw std::bad_alloc;
    /// nothing changed). Call it before the work whose end clear_shifts() records (the
    /// K-shift rotates K first).
    void reserve_clear_shifts() { reserve_journal(n_shifted_); }
    /// Forgets every pending shift (after the K-shift kernel applied them). Under a live mark
    /// call reserve_clear_shifts() first.
    void clear_shifts() noexcept {
        if (n_shifted_ == 0) return;
        const bool rec = recording();
        KVCACHE_ASSERT(!rec || journal_.j.recs.capacity() - journal_.j.recs.size() >= n_shifted_);
        for (std::uint32_t c = 0; c < size(); ++c)
            if (shift_[c] != 0) {
                if (rec) journal_.j.recs.push_back(jrec{jop::set_shift, c, 0, 0, shift_[c]});
                shift_[c] = 0;
            }
        n_shifted_ = 0;
    }
    /// Room in the journal for n changes under a live mark (may throw std::bad_alloc;
    /// nothing changed): for a run of set_shift() calls that must not throw.
    void reserve_journal(std::size_t n) const {
        if (!recording()) return;
        auto& recs = journal_.j.recs;
        if (recs.capacity() - recs.size() < n) recs.reserve(std::max(recs.size() + n, 2 * recs.capacity()));
    }
    [[nodiscard]] snapshot save(std::uint32_t c) const noexcept { return {pos_[c], shift_[c], seqs_[c], ext(c)}; }
    /// Puts cell c back to a saved state, whatever it holds now.
    void load(std::uint32_t c, const snapshot& s) {
        if (!is_free(c)) free_cell(c);
        if (s.pos >= 0) {
            occupy(c, s.pos, s.seqs, s.ext);
            set_shift(c, s.shift);
        }
    }
    /// Attaches the observer told about every later change (nullptr detaches). It must
    /// outlive the table or be detached first; the table does not own it.
    void set_observer(cell_observer* o) noexcept { obs_.p = o; }
    /// The attached observer, or nullptr (memories checkpoint it with the table).
    [[nodiscard]] cell_observer* observer() const noexcept { return obs_.p; }

    // --- rollback points ---

    /// Saves a rollback point: every later change is journaled until release(m) (const: the
    /// journal is not content; the table does not change). May throw
    /// std::bad_alloc (nothing changed). A live m is released first (the same object reused).
    /// Marks nest: roll back the latest saved first (an older one's rollback undoes the
    /// newer ones' changes too: they are then only released).
    void save_mark(mark& m) const {
        if (m.live) release(m);
        m.seq_gen.assign(seq_gen_.begin(), seq_gen_.end());
        reserve_journal(2);
        m.at = journal_.j.recs.size();
        m.stamp = stamp_.v;
        m.n_shifted = n_shifted_;
        m.live = true;
        ++journal_.j.marks;
    }
    /// Undoes every change since m was saved (the observer is not told: its owner restores
    /// it). m stays live. Never allocates, never throws.
    void rollback(mark& m) noexcept {
        KVCACHE_ASSERT(m.live && m.at <= journal_.j.recs.size());
        auto& recs = journal_.j.recs;
        while (recs.size() > m.at) {
            undo(recs.back());
            recs.pop_back();
        }
        stamp_.v = m.stamp;
        n_shifted_ = m.n_shifted;
        std::copy(m.seq_gen.begin(), m.seq_gen.end(), seq_gen_.begin());
    }
    /// Ends a rollback point (its changes are kept). The journal is emptied when no mark is
    /// left. No-op on a mark that is not live. Never throws.
    void release(mark& m) const noexcept {
        if (!m.live) return;
        m.live = false;
        KVCACHE_ASSERT(journal_.j.marks > 0);
        if (--journal_.j.marks == 0) {
            journal_.j.recs.clear();
            journal_.j.pos_nodes.clear();  // drops the kept index nodes
            journal_.j.used_nodes.clear();
        }
    }
    /// Live marks (journaling while > 0).
    [[nodiscard]] std::uint32_t live_marks() const noexcept { return journal_.j.marks; }

    /// Frees every cell.
    void clear() {
        if (recording()) {  // cell by cell, each journaled (the observer hears on_cleared only)
            std::uint32_t n_rm = 0;
            for (auto c : used_) n_rm += static_cast<std::uint32_t>(seqs_[c].count());
            reserve_removals(n_rm, used());
            touch();
            while (!used_.empty()) {
                const std::uint32_t c = *used_.begin();
                const seq_set held = seqs_[c];
                held.for_each([&](seq_id_t s) { rm_seq_unchecked(c, s); });
            }
        } else {
            touch();
            for (auto c : used_) {
                pos_[c] = -1;
                shift_[c] = 0;
                seqs_[c].clear();
                if (!ext_.empty()) ext_[c] = {};
            }
            used_.clear();
            for (auto& m : seq_pos_) m.clear();
        }
        for (auto& g : seq_gen_) g = stamp_.v;
        n_shifted_ = 0;
        if (obs_.p != nullptr) obs_.p->on_cleared();
    }

private:
    using pos_map = std::map<pos_t, std::uint32_t>;
    // Journal records: the inverse of one change (rollback reads the cell's current state
    // for the rest; records are undone newest first).
    enum class jop : std::uint8_t { occupy, add_seq, rm_seq, rm_seq_released, move_pos, set_shift };
    struct jrec {
        jop op;
        std::uint32_t cell = 0;
        seq_id_t seq = 0;          // add_seq, rm_seq
        pos_t pos = 0;             // rm_seq_released, move_pos: the position before
        std::int32_t shift = 0;    // rm_seq_released, move_pos, set_shift: the shift before
        std::uint32_t nodes = 0;   // rm_seq: 1 if its index node was kept; move_pos: nodes kept
        mrope_pos ext{};           // rm_seq_released: the extra positions before
    };
    struct journal {
        std::vector<jrec> recs;
        std::vector<std::pair<seq_id_t, pos_map::node_type>> pos_nodes;  // removed index entries, in record order
        std::vector<std::set<std::uint32_t>::node_type> used_nodes;      // removed used_ entries
        std::uint32_t marks = 0;
    };

    [[nodiscard]] bool recording() const noexcept { return journal_.j.marks > 0; }
    void touch() noexcept { stamp_.v = detail::next_cell_stamp(); }
    void set_shift_raw(std::uint32_t c, std::int32_t d) noexcept {
        n_shifted_ += (d != 0) - (shift_[c] != 0);
        shift_[c] = d;
    }
    void reserve_nodes(std::uint32_t pos_nodes, std::uint32_t used_nodes) {
        if (!recording()) return;
        auto grow = [](auto& v, std::size_t n) {
            if (v.capacity() - v.size() < n) v.reserve(std::max(v.size() + n, 2 * v.capacity()));
        };
        grow(journal_.j.pos_nodes, pos_nodes);
        grow(journal_.j.used_nodes, used_nodes);
    }
    // Room for n sequence removals (and up to `released` freed cells) under a live mark
    // (nothing without one).
    void reserve_removals(std::uint32_t n, std::uint32_t released = 1) {
        reserve_journal(n);
        reserve_nodes(n, released);
    }
    // Adds one count of position p for every sequence of `seqs`; a throw undoes the counts
    // added and runs on_throw (then rethrows).
    template <class F>
    void index_add_all(const seq_set& seqs, pos_t p, F&& on_throw) {
        std::uint32_t added = 0;
        try {
            seqs.for_each([&](seq_id_t s) {
                ++seq_pos_[static_cast<std::size_t>(s)][p];
                ++added;
            });
        } catch (...) {
            std::uint32_t k = 0;
            seqs.for_each([&](seq_id_t s) {
                if (k++ < added) index_dec(s, p);
            });
            on_throw();
            throw;
        }
        seqs.for_each([&](seq_id_t s) { seq_gen_[static_cast<std::size_t>(s)] = stamp_.v; });
    }
    // One count of position p less for sequence s (the entry erased at zero).
    void index_dec(seq_id_t s, pos_t p) noexcept {
        auto& m = seq_pos_[static_cast<std::size_t>(s)];
        auto it = m.find(p);
        KVCACHE_ASSERT(it != m.end());
        if (--it->second == 0) m.erase(it);
    }
    // index_dec that keeps the entry's node in the journal (keep) when it reaches zero;
    // returns 1 if it kept one.
    std::uint32_t index_rm(seq_id_t s, pos_t p, bool keep) noexcept {
        auto& m = seq_pos_[static_cast<std::size_t>(s)];
        auto it = m.find(p);
        KVCACHE_ASSERT(it != m.end());
        seq_gen_[static_cast<std::size_t>(s)] = stamp_.v;
        if (--it->second != 0) return 0;
        if (!keep) {
            m.erase(it);
            return 0;
        }
        journal_.j.pos_nodes.emplace_back(s, m.extract(it));  // room reserved by the caller
        return 1;
    }
    // Puts one count of position p back for sequence s: the kept node when there is one.
    void index_restore(seq_id_t s, pos_t p, bool kept) noexcept {
        auto& m = seq_pos_[static_cast<std::size_t>(s)];
        if (kept) {
            auto& [ks, node] = journal_.j.pos_nodes.back();
            KVCACHE_ASSERT(ks == s && node.key() == p);
            static_cast<void>(ks);
            node.mapped() = 1;
            m.insert(std::move(node));
            journal_.j.pos_nodes.pop_back();
        } else {
            auto it = m.find(p);
            KVCACHE_ASSERT(it != m.end());
            ++it->second;
        }
    }
    // rm_seq without the observer (room in the journal reserved when recording).
    void rm_seq_unchecked(std::uint32_t c, seq_id_t s) noexcept {
        const bool rec = recording();
        touch();
        seqs_[c].reset(s);
        jrec r{jop::rm_seq, c, s};
        r.nodes = index_rm(s, pos_[c], rec);
        if (seqs_[c].none()) {  // the cell is free now
            r.op = jop::rm_seq_released;
            r.pos = pos_[c];
            r.shift = shift_[c];
            r.ext = ext(c);
            if (rec)
                journal_.j.used_nodes.push_back(used_.extract(c));
            else
                used_.erase(c);
            pos_[c] = -1;
            set_shift_raw(c, 0);
            if (!ext_.empty()) ext_[c] = {};
        }
        if (rec) journal_.j.recs.push_back(r);
    }
    void notify_added(std::uint32_t c, const seq_set& seqs) {
        if (obs_.p != nullptr) seqs.for_each([&](seq_id_t s) { obs_.p->on_seq_added(c, s); });
    }
    // The inverse of one journaled change (stamps, shift count and generations are put back
    // by rollback() from the mark).
    void undo(jrec& r) noexcept {
        const std::uint32_t c = r.cell;
        switch (r.op) {
            case jop::occupy:
                seqs_[c].for_each([&](seq_id_t s) { index_dec(s, pos_[c]); });
                seqs_[c].clear();
                used_.erase(c);
                pos_[c] = -1;
                if (!ext_.empty()) ext_[c] = {};
                break;
            case jop::add_seq:
                seqs_[c].reset(r.seq);
                index_dec(r.seq, pos_[c]);
                break;
            case jop::rm_seq_released: {
                pos_[c] = r.pos;
                shift_[c] = r.shift;
                if (!ext_.empty()) ext_[c] = r.ext;
                auto& node = journal_.j.used_nodes.back();
                used_.insert(std::move(node));
                journal_.j.used_nodes.pop_back();
                [[fallthrough]];
            }
            case jop::rm_seq:
                seqs_[c].set(r.seq);
                index_restore(r.seq, pos_[c], r.nodes != 0);
                break;
            case jop::move_pos: {
                const pos_t now = pos_[c];
                // The kept nodes (the last r.nodes of pos_nodes) are the sequences whose entry
                // at the old position was removed; the others still have it.
                seq_set kept_for{};
                for (std::uint32_t i = 0; i < r.nodes; ++i)
                    kept_for.set(journal_.j.pos_nodes[journal_.j.pos_nodes.size() - 1 - i].first);
                seqs_[c].for_each([&](seq_id_t s) {
                    index_dec(s, now);
                    if (!kept_for.test(s)) index_restore(s, r.pos, false);
                });
                for (std::uint32_t i = 0; i < r.nodes; ++i) {
                    const seq_id_t s = journal_.j.pos_nodes.back().first;
                    index_restore(s, r.pos, true);
                }
                pos_[c] = r.pos;
                shift_[c] = r.shift;
                break;
            }
            case jop::set_shift:
                shift_[c] = r.shift;
                break;
        }
    }

    std::vector<pos_t> pos_;            // -1 = free; >= 0 occupied
    std::vector<std::int32_t> shift_;   // 0 for free cells; pos - pos at which K was computed
    std::vector<seq_set> seqs_;         // empty exactly for free cells
    std::vector<mrope_pos> ext_;        // M-RoPE tables: per cell (zero for free cells); else empty
    std::set<std::uint32_t> used_;      // exactly the cells with pos >= 0
    std::vector<std::map<pos_t, std::uint32_t>> seq_pos_;  // per sequence: position -> cell count
    std::vector<std::uint64_t> seq_gen_;  // per sequence: stamp_ of its last change (seq_generation)
    std::uint32_t n_shifted_ = 0;       // cells with shift != 0
    detail::observer_slot obs_;         // not owned; told about every membership change
    detail::stamp_slot stamp_;          // changes with every change of pos_ or seqs_
    mutable detail::journal_slot<journal> journal_;  // changes since the oldest live mark (save_mark)
};

KVCACHE_END_NAMESPACE
