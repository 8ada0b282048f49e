#include "xla_ffi/plan/json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace flexlink::plan::json {

const Value* Value::Find(std::string_view key) const {
  if (type_ != Type::kObject) return nullptr;
  for (const auto& [k, v] : object_) {
    if (k == key) return &v;
  }
  return nullptr;
}

Value& Value::Set(std::string key, Value v) {
  if (type_ == Type::kNull) type_ = Type::kObject;
  for (auto& [k, old] : object_) {
    if (k == key) return old = std::move(v);
  }
  object_.emplace_back(std::move(key), std::move(v));
  return object_.back().second;
}

Value& Value::Push(Value v) {
  if (type_ == Type::kNull) type_ = Type::kArray;
  array_.push_back(std::move(v));
  return array_.back();
}

namespace {

constexpr int kMaxDepth = 64;

class Reader {
 public:
  explicit Reader(std::string_view text) : s_(text) {}

  Status Document(Value* out) {
    FLEXLINK_RETURN_IF_ERROR(ParseValue(out, 0));
    SkipSpace();
    if (pos_ != s_.size()) return Error("trailing characters");
    return Status::Ok();
  }

 private:
  Status Error(const std::string& what) const {
    return Status::InvalidArgument("json: " + what + " at offset " + std::to_string(pos_));
  }
  void SkipSpace() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  bool Consume(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  Status ParseValue(Value* out, int depth) {
    if (depth > kMaxDepth) return Error("nesting too deep");
    SkipSpace();
    if (pos_ >= s_.size()) return Error("unexpected end");
    char c = s_[pos_];
    if (c == '{') return ParseObject(out, depth);
    if (c == '[') return ParseArray(out, depth);
    if (c == '"') {
      std::string str;
      FLEXLINK_RETURN_IF_ERROR(ParseString(&str));
      *out = Value(std::move(str));
      return Status::Ok();
    }
    if (Consume("true")) return *out = Value(true), Status::Ok();
    if (Consume("false")) return *out = Value(false), Status::Ok();
    if (Consume("null")) return *out = Value(), Status::Ok();
    return ParseNumber(out);
  }

  Status ParseNumber(Value* out) {
    size_t start = pos_;
    while (pos_ < s_.size() && std::string_view("+-0123456789.eE").find(s_[pos_]) != std::string_view::npos)
      ++pos_;
    std::string token(s_.substr(start, pos_ - start));
    char* end = nullptr;
    double d = token.empty() ? 0 : std::strtod(token.c_str(), &end);
    if (token.empty() || end != token.c_str() + token.size() || !std::isfinite(d)) {
      pos_ = start;
      return Error("bad value");
    }
    *out = Value(d);
    return Status::Ok();
  }

  Status ParseString(std::string* out) {
    ++pos_;  // opening quote
    while (pos_ < s_.size()) {
      char c = s_[pos_++];
      if (c == '"') return Status::Ok();
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in string");
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) break;
      char e = s_[pos_++];
      switch (e) {
        case '"': case '\\': case '/': out->push_back(e); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          // Names and hosts are ASCII in practice; keep \u escapes of the BMP as UTF-8.
          if (pos_ + 4 > s_.size()) return Error("short \\u escape");
          unsigned cp = 0;
          for (int i = 0; i < 4; ++i) {
            char h = s_[pos_++];
            cp <<= 4;
            if (h >= '0' && h <= '9') cp |= h - '0';
            else if (h >= 'a' && h <= 'f') cp |= h - 'a' + 10;
            else if (h >= 'A' && h <= 'F') cp |= h - 'A' + 10;
            else return Error("bad \\u escape");
          }
          if (cp < 0x80) {
            out->push_back(static_cast<char>(cp));
          } else if (cp < 0x800) {
            out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
            out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
          } else {
            out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
            out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
            out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
          }
          break;
        }
        default: return Error("bad escape");
      }
    }
    return Error("unterminated string");
  }

  Status ParseArray(Value* out, int depth) {
    ++pos_;
    *out = Value::MakeArray();
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == ']') return ++pos_, Status::Ok();
    while (true) {
      Value item;
      FLEXLINK_RETURN_IF_ERROR(ParseValue(&item, depth + 1));
      out->Push(std::move(item));
      SkipSpace();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == ']') return ++pos_, Status::Ok();
      return Error("expected ',' or ']'");
    }
  }

  Status ParseObject(Value* out, int depth) {
    ++pos_;
    *out = Value::MakeObject();
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == '}') return ++pos_, Status::Ok();
    while (true) {
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != '"') return Error("expected a string key");
      std::string key;
      FLEXLINK_RETURN_IF_ERROR(ParseString(&key));
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != ':') return Error("expected ':'");
      ++pos_;
      Value v;
      FLEXLINK_RETURN_IF_ERROR(ParseValue(&v, depth + 1));
      out->Set(std::move(key), std::move(v));
      SkipSpace();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == '}') return ++pos_, Status::Ok();
      return Error("expected ',' or '}'");
    }
  }

  std::string_view s_;
  size_t pos_ = 0;
};

void WriteString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (char c : s) {
    switch (c) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\n': *out += "\\n"; break;
      case '\t': *out += "\\t"; break;
      case '\r': *out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          *out += buf;
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

void WriteValue(const Value& v, int indent, std::string* out) {
  std::string pad(2 * (indent + 1), ' '), close(2 * indent, ' ');
  switch (v.type()) {
    case Value::Type::kNull: *out += "null"; break;
    case Value::Type::kBool: *out += v.as_bool() ? "true" : "false"; break;
    case Value::Type::kNumber: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", v.as_number());
      *out += buf;
      break;
    }
    case Value::Type::kString: WriteString(v.as_string(), out); break;
    case Value::Type::kArray:
      if (v.array().empty()) {
        *out += "[]";
        break;
      }
      *out += "[\n";
      for (size_t i = 0; i < v.array().size(); ++i) {
        *out += pad;
        WriteValue(v.array()[i], indent + 1, out);
        *out += i + 1 < v.array().size() ? ",\n" : "\n";
      }
      *out += close + "]";
      break;
    case Value::Type::kObject:
      if (v.object().empty()) {
        *out += "{}";
        break;
      }
      *out += "{\n";
      for (size_t i = 0; i < v.object().size(); ++i) {
        *out += pad;
        WriteString(v.object()[i].first, out);
        *out += ": ";
        WriteValue(v.object()[i].second, indent + 1, out);
        *out += i + 1 < v.object().size() ? ",\n" : "\n";
      }
      *out += close + "}";
      break;
  }
}

}  // namespace

Status Parse(std::string_view text, Value* out) { return Reader(text).Document(out); }

std::string Write(const Value& v) {
  std::string out;
  WriteValue(v, 0, &out);
  out.push_back('\n');
  return out;
}

}  // namespace flexlink::plan::json
