// A small JSON reader for the real-model test's reference file (no new dependency): the
// whole grammar of RFC 8259 (objects, arrays, strings with escapes, numbers, true, false,
// null), values kept as a tree. Errors throw std::runtime_error naming the byte offset.
#pragma once

#include <cctype>     // std::isdigit
#include <cmath>      // std::isfinite
#include <cstddef>    // std::size_t
#include <cstdint>    // std::uint32_t
#include <cstdlib>    // std::strtod
#include <stdexcept>  // std::runtime_error
#include <string>     // text, keys
#include <utility>    // std::pair
#include <vector>     // arrays, members

namespace json_test {

/// One JSON value.
struct value {
    enum class kind { null, boolean, number, string, array, object };
    kind k = kind::null;
    bool b = false;
    double num = 0;
    std::string str;
    std::vector<value> arr;
    std::vector<std::string> keys;  // an object: member names, and their values in `members`
    std::vector<value> members;

    /// Member `key` of an object; throws when this is not an object or has no such member.
    [[nodiscard]] const value& at(const std::string& key) const {
        if (k != kind::object) throw std::runtime_error("json: '" + key + "' looked up in a non-object");
        for (std::size_t i = 0; i < keys.size(); ++i)
            if (keys[i] == key) return members[i];
        throw std::runtime_error("json: no member '" + key + "'");
    }
    /// This number as an int; throws when it is not an integer in [lo, hi].
    [[nodiscard]] long long as_int(long long lo, long long hi) const {
        if (k != kind::number || num != static_cast<double>(static_cast<long long>(num)) ||
            num < static_cast<double>(lo) || num > static_cast<double>(hi))
            throw std::runtime_error("json: expected an integer in [" + std::to_string(lo) + ", " +
                                     std::to_string(hi) + "], got " + (k == kind::number ? std::to_string(num) : "a non-number"));
        return static_cast<long long>(num);
    }
    /// This array of integers, each in [lo, hi].
    [[nodiscard]] std::vector<int> as_ints(long long lo, long long hi) const {
        if (k != kind::array) throw std::runtime_error("json: expected an array");
        std::vector<int> out;
        for (const value& v : arr) out.push_back(static_cast<int>(v.as_int(lo, hi)));
        return out;
    }
};

namespace detail {
class parser {
public:
    explicit parser(const std::string& text) : s_(text) {}

    value document() {
        value v = parse_value(0);
        skip_ws();
        if (i_ != s_.size()) fail("trailing characters");
        return v;
    }

private:
    [[noreturn]] void fail(const std::string& what) const {
        throw std::runtime_error("json: " + what + " at byte " + std::to_string(i_));
    }
    void skip_ws() {
        while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
    }
    char peek() {
        skip_ws();
        if (i_ >= s_.size()) fail("unexpected end");
        return s_[i_];
    }
    void expect(char c) {
        if (peek() != c) fail(std::string("expected '") + c + "'");
        ++i_;
    }
    void literal(const char* word) {
        for (const char* p = word; *p; ++p, ++i_)
            if (i_ >= s_.size() || s_[i_] != *p) fail(std::string("bad literal, expected ") + word);
    }

    value parse_value(int depth) {
        if (depth > 64) fail("nesting deeper than 64");
        value v;
        const char c = peek();
        if (c == '{') {
            v.k = value::kind::object;
            ++i_;
            if (peek() == '}') { ++i_; return v; }
            for (;;) {
                if (peek() != '"') fail("expected a key");
                std::string key = parse_string();
                expect(':');
                v.keys.push_back(std::move(key));
                v.members.push_back(parse_value(depth + 1));
                if (peek() == ',') { ++i_; continue; }
                expect('}');
                return v;
            }
        }
        if (c == '[') {
            v.k = value::kind::array;
            ++i_;
            if (peek() == ']') { ++i_; return v; }
            for (;;) {
                v.arr.push_back(parse_value(depth + 1));
                if (peek() == ',') { ++i_; continue; }
                expect(']');
                return v;
            }
        }
        if (c == '"') {
            v.k = value::kind::string;
            v.str = parse_string();
            return v;
        }
        if (c == 't') { literal("true"); v.k = value::kind::boolean; v.b = true; return v; }
        if (c == 'f') { literal("false"); v.k = value::kind::boolean; return v; }
        if (c == 'n') { literal("null"); return v; }
        v.k = value::kind::number;
        v.num = parse_number();
        return v;
    }

    double parse_number() {
        const std::size_t start = i_;
        if (i_ < s_.size() && s_[i_] == '-') ++i_;
        auto digits = [&] {
            const std::size_t d0 = i_;
            while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
            if (i_ == d0) fail("expected a digit");
        };
        if (i_ < s_.size() && s_[i_] == '0') ++i_;  // no leading zeros
        else digits();
        if (i_ < s_.size() && s_[i_] == '.') { ++i_; digits(); }
        if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
            ++i_;
            if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
            digits();
        }
        const std::string text = s_.substr(start, i_ - start);
        const double x = std::strtod(text.c_str(), nullptr);
        if (!std::isfinite(x)) fail("number out of range");
        return x;
    }

    static void put_utf8(std::string& o, std::uint32_t cp) {
        if (cp < 0x80) {
            o += static_cast<char>(cp);
        } else if (cp < 0x800) {
            o += static_cast<char>(0xC0 | (cp >> 6));
            o += static_cast<char>(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            o += static_cast<char>(0xE0 | (cp >> 12));
            o += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            o += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
            o += static_cast<char>(0xF0 | (cp >> 18));
            o += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
            o += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            o += static_cast<char>(0x80 | (cp & 0x3F));
        }
    }
    std::uint32_t hex4() {
        std::uint32_t v = 0;
        for (int n = 0; n < 4; ++n, ++i_) {
            if (i_ >= s_.size()) fail("truncated \\u escape");
            const char h = s_[i_];
            v <<= 4;
            if (h >= '0' && h <= '9') v |= static_cast<std::uint32_t>(h - '0');
            else if (h >= 'a' && h <= 'f') v |= static_cast<std::uint32_t>(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') v |= static_cast<std::uint32_t>(h - 'A' + 10);
            else fail("bad hex digit in \\u escape");
        }
        return v;
    }
    std::string parse_string() {
        expect('"');
        std::string o;
        for (;;) {
            if (i_ >= s_.size()) fail("unterminated string");
            const char c = s_[i_++];
            if (c == '"') return o;
            if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
            if (c != '\\') { o += c; continue; }
            if (i_ >= s_.size()) fail("unterminated escape");
            const char e = s_[i_++];
            switch (e) {
                case '"': o += '"'; break;
                case '\\': o += '\\'; break;
                case '/': o += '/'; break;
                case 'b': o += '\b'; break;
                case 'f': o += '\f'; break;
                case 'n': o += '\n'; break;
                case 'r': o += '\r'; break;
                case 't': o += '\t'; break;
                case 'u': {
                    std::uint32_t cp = hex4();
                    if (cp >= 0xD800 && cp < 0xDC00) {  // a surrogate pair
                        if (i_ + 1 >= s_.size() || s_[i_] != '\\' || s_[i_ + 1] != 'u') fail("lone high surrogate");
                        i_ += 2;
                        const std::uint32_t lo = hex4();
                        if (lo < 0xDC00 || lo >= 0xE000) fail("bad low surrogate");
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    } else if (cp >= 0xDC00 && cp < 0xE000) {
                        fail("lone low surrogate");
                    }
                    put_utf8(o, cp);
                    break;
                }
                default: fail(std::string("bad escape \\") + e);
            }
        }
    }

    const std::string& s_;
    std::size_t i_ = 0;
};
}  // namespace detail

/// Parses a whole JSON document; throws std::runtime_error on any syntax error.
[[nodiscard]] inline value parse(const std::string& text) { return detail::parser(text).document(); }

}  // namespace json_test
