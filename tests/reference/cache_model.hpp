// Reference model of kv_cache<...> with the contiguous layout: plain containers and
// loops, written to be obviously correct, no indexes. The model-based tests drive it
// and the real cache with the same operations and compare them after every step.
//
// It mirrors the documented rules exactly:
// - placement: head heuristic (head > used + 2n -> start at 0), first free cells
//   from head, wrapping; head = last placed cell + 1 (0 at the end); restore puts
//   the head back to where it was before the first staged placement.
// - seq_add / seq_div on a shared cell of one sequence split it into the lowest
//   free cells (taken before the operation), in increasing order of the cells split.
#pragma once

#include <kvcache/kvcache.hpp>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace kvtest {

struct model_cell {
    kvcache::pos_t pos = -1;
    std::int32_t shift = 0;
    std::set<kvcache::seq_id_t> seqs;
    std::vector<std::vector<float>> k, v;  // per layer: the values as stored (after element rounding)
};

class cache_model {
public:
    cache_model(const kvcache::model_shape& s, std::uint32_t elem_bits_unused = 0)
        : shape(s), cells(s.n_cells) {
        (void)elem_bits_unused;
    }

    kvcache::model_shape shape;
    std::vector<model_cell> cells;
    std::uint32_t head = 0;
    std::uint32_t head_before_tx = 0;
    std::vector<std::pair<std::uint32_t, model_cell>> staged;  // (cell, state before)

    std::uint32_t used() const {
        std::uint32_t n = 0;
        for (const auto& c : cells) n += c.pos >= 0;
        return n;
    }
    bool seq_has_pos(kvcache::seq_id_t s, kvcache::pos_t p) const {
        for (const auto& c : cells)
            if (c.pos == p && c.seqs.count(s)) return true;
        return false;
    }
    kvcache::pos_t seq_pos_min(kvcache::seq_id_t s) const {
        kvcache::pos_t m = -1;
        for (const auto& c : cells)
            if (c.pos >= 0 && c.seqs.count(s) && (m < 0 || c.pos < m)) m = c.pos;
        return m;
    }
    kvcache::pos_t seq_pos_max(kvcache::seq_id_t s) const {
        kvcache::pos_t m = -1;
        for (const auto& c : cells)
            if (c.pos >= 0 && c.seqs.count(s) && c.pos > m) m = c.pos;
        return m;
    }

    /// Returns the cells chosen, or nullopt when there is not enough room.
    std::optional<std::vector<std::uint32_t>> place(const std::vector<kvcache::pos_t>& pos,
                                                    const std::vector<std::set<kvcache::seq_id_t>>& seqs) {
        const auto n = static_cast<std::uint32_t>(pos.size());
        const auto cap = static_cast<std::uint32_t>(cells.size());
        if (n > cap || n > cap - used()) return std::nullopt;
        if (head > used() + 2 * n) head = 0;
        std::vector<std::uint32_t> out;
        for (std::uint32_t k = 0; k < cap && out.size() < n; ++k) {
            const std::uint32_t c = (head + k) % cap;
            if (cells[c].pos < 0) out.push_back(c);
        }
        if (staged.empty()) head_before_tx = head;
        for (std::uint32_t i = 0; i < n; ++i) {
            staged.emplace_back(out[i], cells[out[i]]);
            cells[out[i]].pos = pos[i];
            cells[out[i]].shift = 0;
            cells[out[i]].seqs = seqs[i];
        }
        if (n > 0) head = (out.back() + 1) % cap;
        return out;
    }
    void write(std::uint32_t layer, std::uint32_t cell, const std::vector<float>& k, const std::vector<float>& v) {
        auto& c = cells[cell];
        c.k.resize(shape.n_layer);
        c.v.resize(shape.n_layer);
        c.k[layer] = k;
        c.v[layer] = v;
    }
    bool commit() {
        const bool any = !staged.empty();
        staged.clear();
        return any;
    }
    bool restore() {
        if (staged.empty()) return false;
        for (auto it = staged.rbegin(); it != staged.rend(); ++it) {
            cells[it->first].pos = it->second.pos;
            cells[it->first].shift = it->second.shift;
            cells[it->first].seqs = it->second.seqs;
        }
        staged.clear();
        head = head_before_tx;
        return true;
    }
    void free_cell(model_cell& c) {
        c.pos = -1;
        c.shift = 0;
        c.seqs.clear();
    }
    static bool in(kvcache::pos_t p, kvcache::pos_t p0, kvcache::pos_t p1) {
        const std::int64_t lo = p0 < 0 ? 0 : p0;
        const std::int64_t hi = p1 < 0 ? std::int64_t{1} << 32 : p1;
        return p >= lo && p < hi;
    }
    void seq_rm(kvcache::seq_id_t s, kvcache::pos_t p0, kvcache::pos_t p1) {
        for (auto& c : cells) {
            if (c.pos < 0 || !in(c.pos, p0, p1)) continue;
            if (s < 0)
                free_cell(c);
            else if (c.seqs.erase(s) && c.seqs.empty())
                free_cell(c);
        }
    }
    void seq_cp(kvcache::seq_id_t src, kvcache::seq_id_t dst, kvcache::pos_t p0, kvcache::pos_t p1) {
        if (src == dst) return;
        for (auto& c : cells)
            if (c.pos >= 0 && in(c.pos, p0, p1) && c.seqs.count(src)) c.seqs.insert(dst);
    }
    void seq_keep(kvcache::seq_id_t s) {
        for (auto& c : cells) {
            if (c.pos < 0) continue;
            if (c.seqs.count(s))
                c.seqs = {s};
            else
                free_cell(c);
        }
    }
    template <class F>
    void move(kvcache::seq_id_t s, kvcache::pos_t p0, kvcache::pos_t p1, F f) {
        std::vector<std::uint32_t> free_cells;
        for (std::uint32_t i = 0; i < cells.size(); ++i)
            if (cells[i].pos < 0) free_cells.push_back(i);
        std::vector<std::uint32_t> hit;  // decided before anything moves
        for (std::uint32_t i = 0; i < cells.size(); ++i) {
            const auto& c = cells[i];
            if (c.pos >= 0 && in(c.pos, p0, p1) && (s < 0 || c.seqs.count(s))) hit.push_back(i);
        }
        std::size_t next = 0;
        for (std::uint32_t i : hit) {
            auto& c = cells[i];
            const std::int64_t np = f(c.pos);
            if (np == c.pos) continue;
            if (np < 0) {
                if (s < 0)
                    free_cell(c);
                else if (c.seqs.erase(s) && c.seqs.empty())
                    free_cell(c);
                continue;
            }
            model_cell* target = &c;
            if (s >= 0 && c.seqs.size() > 1) {
                model_cell& t = cells[free_cells.at(next++)];
                t = c;
                t.seqs = {s};
                c.seqs.erase(s);
                target = &t;
            }
            target->shift += static_cast<std::int32_t>(np - target->pos);
            target->pos = static_cast<kvcache::pos_t>(np);
        }
    }
    void seq_add(kvcache::seq_id_t s, kvcache::pos_t p0, kvcache::pos_t p1, kvcache::pos_t d) {
        if (d == 0) return;
        move(s, p0, p1, [d](kvcache::pos_t p) { return std::int64_t{p} + d; });
    }
    void seq_div(kvcache::seq_id_t s, kvcache::pos_t p0, kvcache::pos_t p1, int d) {
        if (d == 1) return;
        move(s, p0, p1, [d](kvcache::pos_t p) { return std::int64_t{p} / d; });
    }
    void clear() {
        for (auto& c : cells) free_cell(c);
        staged.clear();
        head = 0;
    }
};

}  // namespace kvtest
