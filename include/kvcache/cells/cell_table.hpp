// kvcache: per-cell metadata, shared by all layers (F1), kept apart from K/V data.
//
// Struct of arrays: position, pending K-shift delta and sequence set per cell,
// plus indexes maintained on every change so that the usual queries are O(1) or
// O(log n): used count, first/last used cell, per-sequence position multiset
// (min/max/contains), number of cells with a pending shift. Tables made for M-RoPE
// (with_ext) also keep each cell's extra positions (mrope_pos); the others hold no array for them.
#pragma once

#include <atomic>   // process-wide content stamps
#include <cstdint>  // fixed-width integers
#include <iterator> // std::prev
#include <map>      // per-sequence position multiset
#include <memory>   // observer checkpoints
#include <set>      // ordered used cells
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

    /// Occupies free cell c with position p for the sequences in `seqs` (non-empty).
    /// e: the cell's M-RoPE extra positions (ignored, and must be zero, without has_ext()).
    void occupy(std::uint32_t c, pos_t p, const seq_set& seqs, const mrope_pos& e = {}) {
        KVCACHE_ASSERT(is_free(c) && p >= 0 && seqs.any());
        KVCACHE_ASSERT(!ext_.empty() || e == mrope_pos{});
        touch();
        pos_[c] = p;
        if (!ext_.empty()) ext_[c] = e;
        seqs_[c] = seqs;
        used_.insert(c);
        seqs.for_each([&](seq_id_t s) { index_add(s, p, c); });
    }
    /// Adds sequence s to occupied cell c (no-op if already there).
    void add_seq(std::uint32_t c, seq_id_t s) {
        KVCACHE_ASSERT(!is_free(c));
        if (seqs_[c].test(s)) return;
        touch();
        seqs_[c].set(s);
        index_add(s, pos_[c], c);
    }
    /// Removes sequence s from cell c; frees the cell when no sequence is left.
    void rm_seq(std::uint32_t c, seq_id_t s) {
        KVCACHE_ASSERT(!is_free(c) && seqs_[c].test(s));
        touch();
        seqs_[c].reset(s);
        index_rm(s, pos_[c], c);
        if (seqs_[c].none()) release(c);
    }
    /// Frees cell c, dropping every sequence.
    void free_cell(std::uint32_t c) {
        KVCACHE_ASSERT(!is_free(c));
        touch();
        seqs_[c].for_each([&](seq_id_t s) { index_rm(s, pos_[c], c); });
        seqs_[c].clear();
        release(c);
    }
    /// Moves cell c to position p >= 0 and accumulates the K-shift delta.
    void move_pos(std::uint32_t c, pos_t p) {
        KVCACHE_ASSERT(!is_free(c) && p >= 0);
        const pos_t old = pos_[c];
        if (p == old) return;
        touch();
        seqs_[c].for_each([&](seq_id_t s) {
            index_rm(s, old);
            index_add(s, p);
        });
        set_shift(c, shift_[c] + (p - old));  // fits: both positions in [0, 2^31)
        pos_[c] = p;
    }
    /// Sets the pending shift of cell c (used when a cell's K/V is copied elsewhere).
    void set_shift(std::uint32_t c, std::int32_t d) noexcept {
        n_shifted_ += (d != 0) - (shift_[c] != 0);
        shift_[c] = d;
    }
    /// Forgets every pending shift (after the K-shift kernel applied them).
    void clear_shifts() noexcept {
        if (n_shifted_ == 0) return;
        for (auto& d : shift_) d = 0;
        n_shifted_ = 0;
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

    /// Frees every cell.
    void clear() {
        touch();
        for (auto c : used_) {
            pos_[c] = -1;
            shift_[c] = 0;
            seqs_[c].clear();
            if (!ext_.empty()) ext_[c] = {};
        }
        used_.clear();
        for (auto& m : seq_pos_) m.clear();
        for (auto& g : seq_gen_) g = stamp_.v;
        n_shifted_ = 0;
        if (obs_.p != nullptr) obs_.p->on_cleared();
    }

private:
    void touch() noexcept { stamp_.v = detail::next_cell_stamp(); }
    void release(std::uint32_t c) {
        touch();
        pos_[c] = -1;
        set_shift(c, 0);
        if (!ext_.empty()) ext_[c] = {};
        used_.erase(c);
    }
    // Membership changes of cell c; move_pos passes no cell (membership is unchanged).
    void index_add(seq_id_t s, pos_t p, std::uint32_t c = no_cell) {
        ++seq_pos_[static_cast<std::size_t>(s)][p];
        seq_gen_[static_cast<std::size_t>(s)] = stamp_.v;  // every caller touch()ed first
        if (obs_.p != nullptr && c != no_cell) obs_.p->on_seq_added(c, s);
    }
    void index_rm(seq_id_t s, pos_t p, std::uint32_t c = no_cell) {
        auto& m = seq_pos_[static_cast<std::size_t>(s)];
        auto it = m.find(p);
        KVCACHE_ASSERT(it != m.end());
        if (--it->second == 0) m.erase(it);
        seq_gen_[static_cast<std::size_t>(s)] = stamp_.v;  // every caller touch()ed first
        if (obs_.p != nullptr && c != no_cell) obs_.p->on_seq_removed(c, s);
    }
    static constexpr std::uint32_t no_cell = ~std::uint32_t{0};

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
};

KVCACHE_END_NAMESPACE
