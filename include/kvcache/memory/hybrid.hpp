// kvcache: hybrid_memory, the memory of a model that mixes attention layers with
// recurrent layers (Jamba, Granite 4, Falcon-H1, Nemotron-H, Qwen3-Next), as llama.cpp's
// llama_memory_hybrid.
//
// hybrid_memory<Attention> holds two memories behind one interface:
//   - attention(): Attention (a kv_cache<...> of any layout, or an iswa_cache<...>) for
//     the attention layers;
//   - recurrent(): a recurrent_memory (memory/recurrent.hpp) for the recurrent layers.
// Model layer l maps to layer local_layer(l) of the memory its type selects
// (is_recurrent(l)).
//
// Atomicity: placement, commit/restore and sequence operations apply to both memories
// or to neither. place() places in the recurrent memory first (it refuses only invalid
// arguments, by throwing, before any change), then in the attention memory; when that
// refuses (no_space) or throws, the recurrent placement is undone. Sequence operations
// run on the attention memory first, then on the recurrent memory inside a rollback of
// the attention memory: a refusal of either (the recurrent memory's "refused by
// history", the attention layout's no_space / unsupported) or a throw leaves both
// unchanged. The recurrent memory refuses what its states cannot do (see recurrent.hpp):
// removing, copying or moving only part of a sequence's positions.
//
// The engine runs a batch as: p = place(pos, seq); for each attention layer write_k /
// write_v(l, p, rows) and attention over attention(); for each recurrent layer update
// conv_state(l, s) / ssm_state(l, s) of the batch's sequences (p.recurrent.seqs); then
// commit() (or restore() on failure). seq_pos_min / seq_pos_max are the attention
// memory's (both parts hold the same positions).
//
// State files: io/hybrid.hpp (io::save_state / load_state / save_seq / load_seq, both
// parts or neither). ops:: entry points: call them on attention().
//
// Prefix reuse (slot_manager): the reuse policy is the attention memory's, without chunk
// moves (a recurrent state summarises its tokens in order: chunk reuse, F20, is off).
// reuse::apply_plan below keeps a prefix only when the recurrent part holds exactly it;
// slot_manager resumes from a checkpoint (the whole sequence's io::save_seq bytes, both
// parts) taken at or below the common prefix, else recomputes from 0, and says which
// (request_metrics::checkpoint_restored, miss reason no_checkpoint).
#pragma once

#include <concepts>  // std::constructible_from, std::same_as
#include <cstdint>   // fixed-width integers
#include <span>      // batch inputs
#include <string>    // messages
#include <utility>   // std::pair
#include <vector>    // layer map

#include "../cells/rollback.hpp"
#include "../detail/policy_select.hpp"
#include "../error.hpp"
#include "memory.hpp"
#include "recurrent.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Where one micro-batch went in each part of a hybrid_memory.
template <class AttentionPlacement>
struct hybrid_placement {
    AttentionPlacement attention;   ///< the attention memory's placement
    recurrent_placement recurrent;  ///< the recurrent memory's (state slot of each token)
};

/// Memory of a hybrid model: attention layers in Attention, recurrent layers in a
/// recurrent_memory (see the file comment).
/// Thread safety: as kv_cache (concurrent const calls safe, mutation exclusive).
template <class Attention>
class hybrid_memory {
    static_assert(memory<Attention>, "kvcache: hybrid_memory<Attention> needs Attention to satisfy kvcache::memory "
                                     "(a kv_cache<...> or an iswa_cache<...>)");

public:
    using memory_concept = memory_tag;  // opts in to kvcache::memory (memory.hpp)
    using attention_memory = Attention;
    using placement_type = hybrid_placement<typename Attention::placement_type>;
    /// Positions may move when the attention memory allows it (recurrent states always do).
    static constexpr bool can_shift = Attention::can_shift;
    /// Reuse policy of slot_manager: the attention memory's (never with chunk moves).
    using reuse = typename Attention::reuse;

    /// attention_shape builds the attention memory (a model_shape for kv_cache, an
    /// iswa_shape for iswa_cache) whose n_layer counts the attention layers only;
    /// rec.n_layer counts the recurrent layers; recurrent_layers[l] says whether model
    /// layer l is recurrent. Throws kvcache::error(invalid_config) naming a mismatch.
    template <class AttentionShape>
        requires std::constructible_from<Attention, const AttentionShape&>
    hybrid_memory(const AttentionShape& attention_shape, const recurrent_shape& rec, std::vector<bool> recurrent_layers)
        : attn_(attention_shape), rec_(rec), map_(layer_map(recurrent_layers)) {
        if (attn_.n_seq_max() != rec_.n_seq_max())
            detail::fail(errc::invalid_config, "hybrid_memory: recurrent_shape.n_seq_max = " +
                                                   std::to_string(rec_.n_seq_max()) +
                                                   ", must equal the attention memory's n_seq_max = " +
                                                   std::to_string(attn_.n_seq_max()));
        std::uint32_t n_rec = 0;
        for (bool r : recurrent_layers) n_rec += r;
        const auto n_attn = static_cast<std::uint32_t>(recurrent_layers.size()) - n_rec;
        if (n_rec != rec_.n_layer())
            detail::fail(errc::invalid_config, "hybrid_memory: recurrent_layers marks " + std::to_string(n_rec) +
                                                   " recurrent layers, recurrent_shape.n_layer = " +
                                                   std::to_string(rec_.n_layer()));
        if (n_attn != attn_.n_layer())
            detail::fail(errc::invalid_config, "hybrid_memory: recurrent_layers marks " + std::to_string(n_attn) +
                                                   " attention layers, the attention memory has n_layer = " +
                                                   std::to_string(attn_.n_layer()));
    }

    /// The attention memory (attention kernels, queries, its own state files).
    [[nodiscard]] const Attention& attention() const noexcept { return attn_; }
    /// The recurrent memory (queries, its own state files, checkpoints).
    [[nodiscard]] const recurrent_memory& recurrent() const noexcept { return rec_; }
    [[nodiscard]] std::uint32_t n_layer() const noexcept { return static_cast<std::uint32_t>(map_.size()); }
    [[nodiscard]] std::uint32_t n_seq_max() const noexcept { return attn_.n_seq_max(); }
    /// Whether model layer l is a recurrent layer.
    [[nodiscard]] bool is_recurrent(std::uint32_t l) const { return map_.at(check_layer("is_recurrent", l)).first; }
    /// Index of model layer l inside the memory of its type.
    [[nodiscard]] std::uint32_t local_layer(std::uint32_t l) const {
        return map_.at(check_layer("local_layer", l)).second;
    }

    [[nodiscard]] pos_t seq_pos_min(seq_id_t s) const { return attn_.seq_pos_min(s); }
    [[nodiscard]] pos_t seq_pos_max(seq_id_t s) const { return attn_.seq_pos_max(s); }
    [[nodiscard]] bool in_transaction() const noexcept { return attn_.in_transaction(); }
    /// Whether the attention memory has a pending K-shift (recurrent states never do).
    [[nodiscard]] bool has_shift() const noexcept { return attn_.has_shift(); }
    /// Bytes of both memories' buffers.
    [[nodiscard]] std::size_t total_bytes() const noexcept { return attn_.total_bytes() + rec_.total_bytes(); }

    // ------------------------------------------------------------------ batches

    /// Places a micro-batch in both memories or in neither. Throws invalid_argument for
    /// bad arguments (either memory's rules); error results are the attention memory's
    /// (no_space, batch_too_large).
    [[nodiscard]] result<placement_type> place(std::span<const pos_t> pos, std::span<const seq_id_t> seq) {
        recurrent_memory::place_mark mark;
        rec_.save_mark(mark, detail::internal_access{});
        recurrent_placement rp = rec_.place(pos, seq).value();  // throws on bad arguments, nothing changed
        try {
            auto a = attn_.place(pos, seq);
            if (!a) {
                auto err = detail::make_error(a.code(), a.message());  // may throw: undone once, below
                rec_.undo_place(mark, detail::internal_access{});
                return err;
            }
            return placement_type{std::move(a.value()), std::move(rp)};
        } catch (...) {
            rec_.undo_place(mark, detail::internal_access{});
            throw;
        }
    }

    /// Writes K rows of attention layer l (a model layer) for the placed tokens (float, half
    /// or bfloat16 values, as kv_cache::write_k).
    template <kv_row_value R>
    void write_k(std::uint32_t l, const placement_type& p, const R* rows) { write("write_k", l, p, rows, false); }
    /// Writes V rows of attention layer l for the placed tokens.
    template <kv_row_value R>
    void write_v(std::uint32_t l, const placement_type& p, const R* rows) { write("write_v", l, p, rows, true); }
    /// Float rows (also taking nullptr).
    void write_k(std::uint32_t l, const placement_type& p, const float* rows) { write("write_k", l, p, rows, false); }
    void write_v(std::uint32_t l, const placement_type& p, const float* rows) { write("write_v", l, p, rows, true); }
    /// Convolution state of recurrent model layer l for sequence s (recurrent_memory::conv_state).
    [[nodiscard]] std::span<float> conv_state(std::uint32_t l, seq_id_t s) {
        return rec_.conv_state(recurrent_layer("conv_state", l), s);
    }
    /// SSM / recurrent state of recurrent model layer l for sequence s.
    [[nodiscard]] std::span<float> ssm_state(std::uint32_t l, seq_id_t s) {
        return rec_.ssm_state(recurrent_layer("ssm_state", l), s);
    }

    /// Commits both memories. A throw from the attention memory's commit (an ISWA ring's
    /// pruning: std::bad_alloc) leaves both as before the call (transaction still open).
    tx_result commit() {
        const tx_result r = attn_.commit();  // the only part that can throw: first
        static_cast<void>(rec_.commit());
        return r;
    }
    /// Restores both memories: the attention cells and the recurrent states and
    /// intervals of the staged placements. Never throws.
    tx_result restore() noexcept {
        static_cast<void>(rec_.restore());
        return attn_.restore();
    }

    // ---------------------------------------------------------- sequence ops (F5)

    /// seq_rm on both memories or neither. Error results: the recurrent memory's refusal
    /// by history (a range that cuts a sequence), the attention layout's refusals.
    [[nodiscard]] result<void> seq_rm(seq_id_t s, pos_t p0, pos_t p1) {
        return both([&] { return attn_.seq_rm(s, p0, p1); }, [&] { return rec_.seq_rm(s, p0, p1); });
    }
    /// seq_cp on both memories or neither (the recurrent state is copied). Throws
    /// invalid_argument when dst already holds a state.
    [[nodiscard]] result<void> seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
        return both([&] { return attn_.seq_cp(src, dst, p0, p1); }, [&] { return rec_.seq_cp(src, dst, p0, p1); });
    }
    void seq_keep(seq_id_t s) {
        static_cast<void>(both(
            [&]() -> result<void> {
                attn_.seq_keep(s);
                return {};
            },
            [&]() -> result<void> {
                rec_.seq_keep(s);
                return {};
            }));
    }
    /// seq_add on both memories or neither (error results as seq_rm, and no_space from
    /// the attention memory).
    [[nodiscard]] result<void> seq_add(seq_id_t s, pos_t p0, pos_t p1, pos_t delta) {
        return both([&] { return attn_.seq_add(s, p0, p1, delta); }, [&] { return rec_.seq_add(s, p0, p1, delta); });
    }
    /// seq_div on both memories or neither (error results as seq_add).
    [[nodiscard]] result<void> seq_div(seq_id_t s, pos_t p0, pos_t p1, int d) {
        return both([&] { return attn_.seq_div(s, p0, p1, d); }, [&] { return rec_.seq_div(s, p0, p1, d); });
    }
    /// Empties both memories and drops staged placements.
    void clear() {
        attn_.clear();  // strong guarantee; may throw std::bad_alloc before any change
        rec_.clear();
    }

    /// The journal of a compound operation (slot_manager::prepare / release): both parts'
    /// (kv_cache::journal_mark, recurrent_memory::journal_mark) with their guards.
    struct journal_mark {
        typename Attention::journal_mark attention;
        recurrent_memory::journal_mark recurrent;
    };
    void save_journal(journal_mark& m, detail::internal_access a) const {
        attn_.save_journal(m.attention, a);
        rec_.save_journal(m.recurrent, a);
    }
    void load_journal(journal_mark& m, detail::internal_access a) noexcept {
        attn_.load_journal(m.attention, a);
        rec_.load_journal(m.recurrent, a);
    }
    void begin_guard(const journal_mark& m, detail::internal_access a) {
        attn_.begin_guard(m.attention, a);
        try {
            rec_.begin_guard(m.recurrent, a);
        } catch (...) {
            attn_.end_guard(a);
            throw;
        }
    }
    void end_guard(detail::internal_access a) noexcept {
        attn_.end_guard(a);
        rec_.end_guard(a);
    }
    void rollback_guard(detail::internal_access a) noexcept {
        attn_.rollback_guard(a);
        rec_.rollback_guard(a);
    }

    /// Mutable parts, for library operations (ops::apply_k_shift on the attention part)
    /// that keep both consistent themselves. Not for host code.
    [[nodiscard]] Attention& attention_for_update(detail::internal_access) noexcept { return attn_; }
    /// Mutable recurrent part, for io/hybrid.hpp (loads both parts or neither). Not for host code.
    [[nodiscard]] recurrent_memory& recurrent_for_update(detail::internal_access) noexcept { return rec_; }

private:
    /// Runs fa on the attention memory, then fr on the recurrent memory; a refusal or a
    /// throw of either leaves both unchanged.
    template <class FA, class FR>
    result<void> both(FA&& fa, FR&& fr) {
        return detail::with_rollback(attn_, [&]() -> result<void> {
            if (result<void> r = fa(); !r) return r;
            return fr();  // atomic: refuses or throws with nothing changed
        });
    }
    std::uint32_t check_layer(const char* fn, std::uint32_t l) const {
        if (l >= map_.size()) bad_layer(fn, l, map_.size());
        return l;
    }
    /// Out of line: GCC 12 reports a false -Warray-bounds on the message when inlined.
    [[noreturn]] [[gnu::noinline]] [[gnu::cold]] static void bad_layer(const char* fn, std::uint32_t l, std::size_t n) {
        detail::fail(errc::invalid_argument,
                     std::string(fn) + ": layer = " + std::to_string(l) + ", must be < n_layer = " + std::to_string(n));
    }
    std::uint32_t recurrent_layer(const char* fn, std::uint32_t l) const {
        const auto [rec, local] = map_.at(check_layer(fn, l));
        if (!rec)
            detail::fail(errc::invalid_argument,
                         std::string(fn) + ": layer " + std::to_string(l) + " is an attention layer, not recurrent");
        return local;
    }
    template <class R>
    void write(const char* fn, std::uint32_t l, const placement_type& p, const R* rows, bool is_v) {
        const auto [rec, local] = map_.at(check_layer(fn, l));
        if (rec)
            detail::fail(errc::invalid_argument,
                         std::string(fn) + ": layer " + std::to_string(l) + " is a recurrent layer, not attention");
        if constexpr (std::same_as<typename Attention::placement_type, placement>) {  // kv_cache: its cells
            if (is_v)
                attn_.write_v(local, p.attention.cells, rows);
            else
                attn_.write_k(local, p.attention.cells, rows);
        } else {  // iswa_cache: its own placement
            if (is_v)
                attn_.write_v(local, p.attention, rows);
            else
                attn_.write_k(local, p.attention, rows);
        }
    }
    static std::vector<std::pair<bool, std::uint32_t>> layer_map(const std::vector<bool>& recurrent_layers) {
        std::vector<std::pair<bool, std::uint32_t>> m;
        std::uint32_t n_rec = 0, n_attn = 0;
        for (bool r : recurrent_layers) m.emplace_back(r, r ? n_rec++ : n_attn++);
        if (n_rec == 0 || n_attn == 0)
            detail::fail(errc::invalid_config, std::string("hybrid_memory: recurrent_layers has no ") +
                                                   (n_rec == 0 ? "recurrent" : "attention") +
                                                   " layer; use the memory of the other kind directly");
        return m;
    }

    Attention attn_;
    recurrent_memory rec_;
    std::vector<std::pair<bool, std::uint32_t>> map_;  // per model layer: (is recurrent, index in its memory)
};

namespace reuse {
/// reuse::apply_plan on a hybrid_memory: keeps positions [0, n_past) of seq in both parts
/// (seq_rm of the rest), which the recurrent part allows only when it holds exactly
/// [0, n_past) or n_past is 0: otherwise refused (errc::unsupported, refused by history),
/// neither part changed. Throws invalid_argument (bad seq, a plan with chunk moves: chunk
/// reuse is off for recurrent layers) or transaction_open.
template <class A>
[[nodiscard]] result<void> apply_plan(hybrid_memory<A>& mem, seq_id_t seq, const plan& p) {
    check_apply_args(seq, mem.n_seq_max(), mem.in_transaction(), p);
    if (!p.moves.empty())
        detail::fail(errc::invalid_argument, "apply_plan: the plan moves chunks, but chunk reuse is off for the "
                                             "recurrent layers of a hybrid memory");
    return mem.seq_rm(seq, static_cast<pos_t>(p.n_past), -1);
}
}  // namespace reuse

KVCACHE_END_NAMESPACE
