// Test helper: a complete, comparable picture of a memory (kv_cache of any layout or
// iswa_cache) as text lines: cell metadata, the cell table's indexes, a hash of every
// occupied cell's K/V bytes, block tables, refcounts, free blocks, ring pruning points,
// the transaction state, the live rollback points. Used by the fault-injection sweep and
// the API fuzzer to check that a refused or failed operation left the memory bit-identical
// (and that no rollback point outlived its operation).
#pragma once

#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace kvtest {

using kvcache::cell_table;
using kvcache::seq_id_t;

struct snap {
    std::vector<std::string> lines;  // one per fact; compared as a whole, first difference reported
    bool operator==(const snap&) const = default;
};
inline std::string first_diff(const snap& a, const snap& b) {
    for (std::size_t i = 0; i < std::max(a.lines.size(), b.lines.size()); ++i) {
        const std::string x = i < a.lines.size() ? a.lines[i] : "<none>";
        const std::string y = i < b.lines.size() ? b.lines[i] : "<none>";
        if (x != y) {
            std::ostringstream os;
            os << "line " << i << ": [" << x << "] vs [" << y << "]";
            return os.str();
        }
    }
    return "";
}

template <class Cache>
void snapshot_into(const Cache& c, const std::string& tag, snap& out) {
    // ostringstream, not operator+ chains (GCC 12 reports a false -Wrestrict on those)
    auto line = [&](auto&&... parts) {
        std::ostringstream os;
        os << tag;
        ((os << ' ' << parts), ...);
        out.lines.push_back(os.str());
    };
    const cell_table& t = c.cells();
    // live rollback points (cell_table::mark): one that outlives its operation would show
    line("used", t.used(), "shifted", t.n_shifted(), "tx", c.in_transaction(), "marks", t.live_marks());
    {
        std::ostringstream os;
        for (std::uint32_t x : t.used_cells()) os << x << ',';
        line("used_cells", os.str());
    }
    std::vector<typename Cache::storage_type> bytes;
    for (std::uint32_t x = 0; x < t.size(); ++x) {
        if (t.is_free(x)) {
            if (t.shift(x) != 0 || t.seqs(x).any()) line("free cell with state", x);
            continue;
        }
        std::ostringstream os;
        os << "pos " << t.pos(x) << " shift " << t.shift(x) << " seqs";
        t.seqs(x).for_each([&](seq_id_t s) { os << ' ' << s; });
        for (std::uint32_t layer = 0; layer < c.shape().n_layer; ++layer)
            for (bool v : {false, true}) {
                c.storage().cell_bytes(layer, x, v, bytes);
                std::uint64_t h = 1469598103934665603ull;  // FNV-1a of the raw bytes
                const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
                for (std::size_t i = 0; i < bytes.size() * sizeof(bytes[0]); ++i) h = (h ^ p[i]) * 1099511628211ull;
                os << ' ' << h;
            }
        line("cell", x, os.str());
    }
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(t.n_seq_max()); ++s) {
        std::ostringstream os;
        for (const auto& [p, n] : t.seq_positions(s)) os << ' ' << p << 'x' << n;
        line("seq", s, os.str(), "min", t.seq_pos_min(s), "max", t.seq_pos_max(s));
    }
    using st = typename Cache::storage_t;
    if constexpr (requires(const st& x) { x.block_table(0); }) {
        const auto& s = c.storage();
        line("blocks free", s.free_blocks(), "referenced", s.referenced_blocks(), "invariants", s.check_invariants(t));
        for (std::uint32_t b = 0; b < s.n_blocks(); ++b)
            line("block", b, "refcount", s.refcount(b), "used", s.used_in_block(b));
        for (seq_id_t q = 0; q < static_cast<seq_id_t>(t.n_seq_max()); ++q) {
            std::ostringstream os;
            for (std::uint32_t b : s.block_table(q)) os << ' ' << b;
            line("table", q, os.str());
        }
    }
    if constexpr (requires(const st& x) { x.pruned_below(0); }) {
        std::ostringstream os;
        for (seq_id_t q = 0; q < static_cast<seq_id_t>(t.n_seq_max()); ++q) os << ' ' << c.storage().pruned_below(q);
        line("pruned", os.str());
    }
}
template <class M>
snap snapshot(const M& m) {
    snap out;
    if constexpr (requires { m.full(); m.swa(); }) {
        snapshot_into(m.full(), "full", out);
        snapshot_into(m.swa(), "swa", out);
    } else {
        snapshot_into(m, "cache", out);
    }
    return out;
}

}  // namespace kvtest
