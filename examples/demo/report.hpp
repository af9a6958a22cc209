// kvcache_demo: the results and how they are reported: the TTFT rows and the checks of
// the context-shift / Self-Extend runs, printed as Markdown tables and written as JSON
// through json_writer (the only place that formats JSON: it escapes every string).
#pragma once

#include <cmath>        // std::isfinite
#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint32_t
#include <cstdio>       // std::printf, std::snprintf
#include <fstream>      // write_json
#include <optional>     // expected ratios
#include <ostream>      // json_writer
#include <stdexcept>    // std::logic_error
#include <string>       // names
#include <string_view>  // json_writer
#include <type_traits>  // json_writer::value
#include <vector>       // rows, checks

#include <kvcache/kvcache.hpp>

namespace demo::report {

/// One row of the TTFT table.
struct row {
    std::string scenario;
    std::string cache_type = "f32";  ///< K/V element of the run (--cache-type)
    int round = 0;
    std::string what;  ///< short description of the request
    std::size_t n_prompt = 0;
    kvcache::request_metrics m;
    double ttft_ms = 0;
    double ratio = 1;
    std::optional<double> expected_max;  ///< none: the cold baseline of its scenario (or the control)
    std::optional<double> expected_min;  ///< the control must not be fast: nothing is reused
    std::string check = "-";             ///< logits check summary
    bool check_ok = true;
    double max_abs_diff = -1;  ///< < 0: not checked
    bool argmax_match = true;
    bool pass = true;
    /// The ratio is outside its expected range (timing on): reported, and a failure only
    /// with --strict-timing (a busy machine's timings are noise; correctness decides).
    bool off_target = false;
    /// Hybrid model rows (--hybrid): the slot's checkpoint bytes after the request; the JSON
    /// row then also names the miss reason and whether a checkpoint was restored.
    std::optional<std::size_t> checkpoint_bytes;
    /// Tier rows (--tiers): the storage tier that served the prefix ("": none; m.from_tier
    /// positions came from it), and whether the row was skipped (its tier not configured).
    std::string tier;
    bool skipped = false;
};

/// Outcome of the context-shift and Self-Extend runs, for the final summary and the JSON.
struct check_result {
    std::string name;
    std::string summary;
    bool pass = false;
};

/// Judges a row once its check_ok, ratio and expected range are set: it passes on its
/// correctness check; with timing on, a ratio outside the expected range marks it
/// off_target, which fails it only when strict (--strict-timing).
inline void judge(row& x, bool timing, bool strict) {
    const bool in_range = (!x.expected_max || x.ratio <= *x.expected_max) && (!x.expected_min || x.ratio >= *x.expected_min);
    x.off_target = timing && !in_range;
    x.pass = x.check_ok && !(strict && x.off_target);
}

/// The result label of a row: PASS, OFF TARGET (passed its checks, timing outside the
/// expected range) or FAIL.
inline const char* result_label(const row& x) noexcept {
    if (!x.pass) return "FAIL";
    return x.off_target ? "OFF TARGET" : "PASS";
}

/// Where a request's reused tokens came from, e.g. "100 slot 600 shifted", "999 disk" (a
/// storage tier, named by `tier`), or "-".
inline std::string reuse_summary(const kvcache::request_metrics& m, const std::string& tier = "") {
    std::string s;
    auto part = [&](std::uint32_t n, const char* from) {
        if (n == 0) return;
        if (!s.empty()) s += ' ';
        s += std::to_string(n) + ' ' + from;
    };
    part(m.from_slot, "slot");
    part(m.from_global, "global");
    part(m.from_shift, "shifted");
    part(m.from_tier, tier.empty() ? "tier" : tier.c_str());
    return s.empty() ? "-" : s;
}

/// Prints the TTFT rows as a Markdown table.
inline void print_table(const std::vector<row>& rows) {
    std::printf("\n| scenario | round | request | tokens | reused | computed | TTFT ms | ratio | expected | logits | result |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const row& x : rows) {
        char expected[32];
        if (x.expected_max)
            std::snprintf(expected, sizeof expected, "<= %.0f%%", 100.0 * *x.expected_max);
        else if (x.expected_min)
            std::snprintf(expected, sizeof expected, ">= %.0f%% (no reuse)", 100.0 * *x.expected_min);
        else
            std::snprintf(expected, sizeof expected, "baseline");
        if (x.skipped) {
            std::printf("| %s | R%d | %s | %zu | - | - | - | - | %s | %s | SKIPPED |\n", x.scenario.c_str(), x.round,
                        x.what.c_str(), x.n_prompt, expected, x.check.c_str());
            continue;
        }
        std::printf("| %s | R%d | %s | %zu | %s | %u | %.1f | %.1f%% | %s | %s | %s |\n", x.scenario.c_str(), x.round,
                    x.what.c_str(), x.n_prompt, reuse_summary(x.m, x.tier).c_str(), x.m.computed, x.ttft_ms, 100.0 * x.ratio,
                    expected, x.check.c_str(), result_label(x));
    }
}

/// Prints the checks of the context-shift / Self-Extend runs as a Markdown table.
inline void print_checks(const std::vector<check_result>& checks) {
    std::printf("\n| run | what was checked | result |\n|---|---|---|\n");
    for (const check_result& c : checks)
        std::printf("| %s | %s | %s |\n", c.name.c_str(), c.summary.c_str(), c.pass ? "PASS" : "FAIL");
}

/// A small streaming JSON writer. Containers are opened multi-line (one element per line,
/// indented two spaces per level) or inline ("{"a": 1, "b": 2}"); keys and string values
/// are escaped (quote, backslash, control characters as \n, \t, ... or \u00XX); numbers
/// are written with the stream's default format, non-finite ones as null (JSON has no
/// NaN or infinity). Misuse (a value where a key is due, unbalanced containers) throws
/// std::logic_error.
class json_writer {
public:
    explicit json_writer(std::ostream& out) : out_(out) {}

    /// `s` as a JSON string literal, quotes included.
    [[nodiscard]] static std::string quote(std::string_view s) {
        static const char hex[] = "0123456789abcdef";
        std::string o = "\"";
        for (const char ch : s) {
            const auto c = static_cast<unsigned char>(ch);
            switch (c) {
                case '"': o += "\\\""; break;
                case '\\': o += "\\\\"; break;
                case '\b': o += "\\b"; break;
                case '\f': o += "\\f"; break;
                case '\n': o += "\\n"; break;
                case '\r': o += "\\r"; break;
                case '\t': o += "\\t"; break;
                default:
                    if (c < 0x20) {
                        o += "\\u00";
                        o += hex[c >> 4];
                        o += hex[c & 15];
                    } else {
                        o += ch;  // UTF-8 bytes pass through
                    }
            }
        }
        return o + '"';
    }

    json_writer& begin_object(bool multiline = false) { return open('{', multiline); }
    json_writer& end_object() { return close('}'); }
    json_writer& begin_array(bool multiline = false) { return open('[', multiline); }
    json_writer& end_array() { return close(']'); }

    /// The key of the next member of the current object.
    json_writer& key(std::string_view k) {
        if (stack_.empty() || stack_.back().bracket != '}' || key_pending_)
            throw std::logic_error("json_writer: a key outside an object or twice in a row");
        separator();
        out_ << quote(k) << ": ";
        key_pending_ = true;
        return *this;
    }

    json_writer& value(std::string_view s) {
        element();
        out_ << quote(s);
        return *this;
    }
    json_writer& value(const char* s) { return value(std::string_view(s)); }
    json_writer& value(const std::string& s) { return value(std::string_view(s)); }
    json_writer& value(bool b) {
        element();
        out_ << (b ? "true" : "false");
        return *this;
    }
    template <class T>
        requires std::is_arithmetic_v<T>
    json_writer& value(T x) {
        element();
        if constexpr (std::is_floating_point_v<T>) {
            if (!std::isfinite(x)) {
                out_ << "null";
                return *this;
            }
        }
        out_ << x;
        return *this;
    }
    /// An optional number: null when empty.
    template <class T>
    json_writer& value(const std::optional<T>& x) {
        if (x) return value(*x);
        return null();
    }
    json_writer& null() {
        element();
        out_ << "null";
        return *this;
    }

    /// Shorthand for key(k).value(v).
    template <class T>
    json_writer& member(std::string_view k, const T& v) {
        return key(k).value(v);
    }

    /// True when every container opened was closed.
    [[nodiscard]] bool done() const noexcept { return stack_.empty() && started_; }

private:
    struct level {
        char bracket;  // the closing bracket
        bool multiline;
        bool empty = true;
    };

    void indent(std::size_t depth) {
        for (std::size_t i = 0; i < depth; ++i) out_ << "  ";
    }
    /// Before an element of the current container: ", " or ",\n" + indent.
    void separator() {
        level& l = stack_.back();
        if (l.multiline) {
            out_ << (l.empty ? "\n" : ",\n");
            indent(stack_.size());
        } else if (!l.empty) {
            out_ << ", ";
        }
        l.empty = false;
    }
    /// Before a value: after its key in an object, after a separator in an array.
    void element() {
        if (stack_.empty()) {
            if (started_) throw std::logic_error("json_writer: a second top-level value");
            started_ = true;
            return;
        }
        if (stack_.back().bracket == '}') {
            if (!key_pending_) throw std::logic_error("json_writer: an object member without a key");
            key_pending_ = false;
        } else {
            separator();
        }
    }
    json_writer& open(char bracket, bool multiline) {
        element();
        out_ << bracket;
        stack_.push_back({bracket == '{' ? '}' : ']', multiline});
        return *this;
    }
    json_writer& close(char bracket) {
        if (stack_.empty() || stack_.back().bracket != bracket || key_pending_)
            throw std::logic_error(std::string("json_writer: unbalanced '") + bracket + "'");
        const level l = stack_.back();
        stack_.pop_back();
        if (l.multiline) {
            out_ << '\n';
            indent(stack_.size());
        }
        out_ << bracket;
        return *this;
    }

    std::ostream& out_;
    std::vector<level> stack_;
    bool key_pending_ = false;
    bool started_ = false;
};

/// Writes the rows and the checks as one JSON document to `out`:
/// {"machine": ..., "rows": [{...}, ...], "checks": [{...}, ...]}. Rows of the tier scenario
/// (or with positions from a storage tier) also carry from_tier, tier (null: none) and skipped.
inline void write_json(std::ostream& out, const std::vector<row>& rows, const std::string& machine,
                       const std::vector<check_result>& checks) {
    json_writer j(out);
    j.begin_object(true).member("machine", machine);
    j.key("rows").begin_array(true);
    for (const row& x : rows) {
        j.begin_object()
            .member("scenario", x.scenario)
            .member("cache_type", x.cache_type)
            .member("round", x.round)
            .member("ttft_ms", x.ttft_ms)
            .member("ratio", x.ratio)
            .member("expected_max_ratio", x.expected_max)
            .member("expected_min_ratio", x.expected_min)
            .member("pass", x.pass)
            .member("off_target", x.off_target)
            .member("request", x.what)
            .member("n_prompt", x.n_prompt)
            .member("computed", x.m.computed)
            .member("from_slot", x.m.from_slot)
            .member("from_global", x.m.from_global)
            .member("from_shift", x.m.from_shift)
            .member("logits_max_abs_diff",
                    x.max_abs_diff >= 0 ? std::optional<double>(x.max_abs_diff) : std::optional<double>())
            .member("logits_argmax_match", x.argmax_match)
            .member("logits_check_ok", x.check_ok);
        if (x.scenario == "tiers" || x.m.from_tier > 0) {  // the storage-tier rows (--tiers)
            j.member("from_tier", x.m.from_tier).key("tier");
            if (x.tier.empty()) j.null();
            else j.value(x.tier);
            j.member("skipped", x.skipped);
        }
        if (x.checkpoint_bytes)
            j.member("miss_reason", std::string(kvcache::to_string(x.m.miss)))
                .member("checkpoint_restored", x.m.checkpoint_restored)
                .member("checkpoint_bytes_per_slot", *x.checkpoint_bytes);
        j.end_object();
    }
    j.end_array();
    j.key("checks").begin_array(true);
    for (const check_result& c : checks)
        j.begin_object().member("name", c.name).member("summary", c.summary).member("pass", c.pass).end_object();
    j.end_array();
    j.end_object();
    out << '\n';
}

/// write_json to the file `path`; false when it cannot be written.
inline bool write_json(const std::string& path, const std::vector<row>& rows, const std::string& machine,
                       const std::vector<check_result>& checks) {
    std::ofstream out(path);
    if (!out) return false;
    write_json(out, rows, machine, checks);
    out.flush();
    return static_cast<bool>(out);
}

}  // namespace demo::report
