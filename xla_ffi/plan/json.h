// A small JSON value, reader and writer: just what the tuning cache needs, so the planning layer has
// no dependency beyond the standard library. Objects keep insertion order (the cache file stays
// readable and diffs stay small); numbers are doubles written with 17 significant digits, so a fit
// round-trips bit-exactly. The reader rejects anything malformed with the byte offset, and limits
// nesting, so a corrupt or hostile cache file yields an error, never a crash.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "xla_ffi/core/status.h"

namespace flexlink::plan::json {

class Value {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  using Array = std::vector<Value>;
  using Object = std::vector<std::pair<std::string, Value>>;

  Value() = default;
  Value(bool b) : type_(Type::kBool), bool_(b) {}
  Value(double d) : type_(Type::kNumber), number_(d) {}
  Value(std::string s) : type_(Type::kString), string_(std::move(s)) {}
  Value(const char* s) : Value(std::string(s)) {}
  static Value MakeArray() { return Value(Type::kArray); }
  static Value MakeObject() { return Value(Type::kObject); }

  Type type() const { return type_; }
  bool is_number() const { return type_ == Type::kNumber; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }
  bool as_bool() const { return bool_; }
  double as_number() const { return number_; }
  const std::string& as_string() const { return string_; }
  const Array& array() const { return array_; }
  Array& array() { return array_; }
  const Object& object() const { return object_; }

  // Object member by key (first match), or nullptr (also when this is not an object).
  const Value* Find(std::string_view key) const;
  // Sets an object member (replacing an existing one); makes this an object if it is null.
  Value& Set(std::string key, Value v);
  // Appends to an array; makes this an array if it is null.
  Value& Push(Value v);

 private:
  explicit Value(Type t) : type_(t) {}
  Type type_ = Type::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  Array array_;
  Object object_;
};

// Parses one JSON document (surrounding whitespace allowed). Errors: "json: <what> at offset N".
Status Parse(std::string_view text, Value* out);
// Pretty-printed with two-space indentation and a trailing newline.
std::string Write(const Value& v);

}  // namespace flexlink::plan::json
