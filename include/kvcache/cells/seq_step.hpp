// kvcache: one step of a change made of several sequence operations on one sequence
// (reuse::apply_plan's chunk moves, ops::self_extend's rounds). Callers list the steps
// so that a layout with rules that depend on earlier steps (ring: pruned positions) can
// check the whole list through its check_seq_steps hook before the first one runs.
#pragma once

#include <cstdint>  // std::uint8_t, std::int64_t
#include <string>   // describe

#include "../error.hpp"
#include "../model_shape.hpp"

KVCACHE_BEGIN_NAMESPACE

/// One sequence operation on a sequence s: seq_rm(s, p0, p1), seq_add(s, p0, p1, arg) or
/// seq_div(s, p0, p1, arg); p0 < 0 means 0 and p1 < 0 the end, as in those calls.
struct seq_step {
    enum class op : std::uint8_t { rm, add, div };
    op kind = op::rm;
    pos_t p0 = 0;
    pos_t p1 = -1;
    pos_t arg = 0;  ///< delta of add, divisor of div; unused by rm
};

/// New position of a cell that seq_add (p + arg) or seq_div (p / arg, arg > 0) moves: the
/// function a layout's check_seq_shift hook receives (layout/capabilities.hpp).
struct position_move {
    enum class op : std::uint8_t { add, div };
    op kind = op::add;
    std::int64_t arg = 0;  ///< delta of add, divisor (> 0) of div

    [[nodiscard]] constexpr std::int64_t operator()(pos_t p) const noexcept {
        return kind == op::add ? std::int64_t{p} + arg : std::int64_t{p} / arg;
    }
};

/// The call a step stands for, e.g. "seq_add(0, 27, end, -2)", for messages.
[[nodiscard]] inline std::string describe(const seq_step& st, seq_id_t s) {
    const char* fn = st.kind == seq_step::op::rm ? "seq_rm(" : st.kind == seq_step::op::add ? "seq_add(" : "seq_div(";
    std::string out = fn + std::to_string(s) + ", " + std::to_string(st.p0) + ", " +
                      (st.p1 < 0 ? std::string("end") : std::to_string(st.p1));
    if (st.kind != seq_step::op::rm) out += ", " + std::to_string(st.arg);
    return out + ")";
}

/// Runs one step on sequence s of cache (its seq_rm, seq_add or seq_div) and returns
/// that call's result (an error result: the call refused, nothing changed).
template <class Cache>
[[nodiscard]] result<void> run_step(Cache& cache, seq_id_t s, const seq_step& st) {
    switch (st.kind) {
        case seq_step::op::rm: return cache.seq_rm(s, st.p0, st.p1);
        case seq_step::op::add: return cache.seq_add(s, st.p0, st.p1, st.arg);
        case seq_step::op::div: return cache.seq_div(s, st.p0, st.p1, static_cast<int>(st.arg));
    }
    return {};
}

KVCACHE_END_NAMESPACE
