#include "ir/parser.h"

#include "ir/printer.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

namespace torch_ext::ir {
namespace {

// Recursion limits: the parser (and the printer, verifier and executors after it) recurse once
// per level, so deep text would overflow the stack. Real graphs nest a few levels at most.
constexpr int kMaxTypeDepth = 64;    // tuple types: (f32[2], (i64[], ...))
constexpr int kMaxListDepth = 64;    // argument lists: [[1, 2], [3]]
constexpr int kMaxRegionDepth = 32;  // regions of cond / while_loop inside each other

// Length of the UTF-8 sequence starting at `s[i]`, or 0 when it is not a valid sequence.
size_t utf8_sequence_length(const std::string& s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  if (len == 0 || i + len > s.size()) return 0;
  for (size_t k = 1; k < len; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  return len;
}

// At most `max_chars` characters of `s` from `begin` up to `end`, never splitting a UTF-8
// character (Python decodes the message strictly); invalid bytes become '?'.
std::string utf8_excerpt(const std::string& s, size_t begin, size_t end, size_t max_chars) {
  std::string out;
  size_t i = begin;
  // Never start inside a character.
  while (i < end && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) ++i;
  for (size_t chars = 0; i < end && chars < max_chars; ++chars) {
    const size_t len = utf8_sequence_length(s, i);
    if (len == 0 || i + len > end) {
      out += '?';
      ++i;
      continue;
    }
    out.append(s, i, len);
    i += len;
  }
  return out;
}

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  std::unique_ptr<Graph> parse_top() {
    skip_blank();
    auto g = parse_graph();
    skip_blank();
    if (pos_ < s_.size()) fail("unexpected text after the graph's return statement");
    return g;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        col = 1;
      } else if ((static_cast<unsigned char>(s_[i]) & 0xC0) != 0x80) {
        ++col;  // columns count characters, not UTF-8 continuation bytes
      }
    }
    const size_t from = std::min(pos_, s_.size());
    size_t end = s_.find('\n', from);
    std::string near = utf8_excerpt(s_, from, end == std::string::npos ? s_.size() : end, 40);
    TORCH_CHECK(false, "IR parse error at line ", line, ", column ", col, ": ", what, " (near '", near, "')");
  }

  // Counts one nesting level for the lifetime of the guard; refuses text nested beyond `limit`.
  class DepthGuard {
   public:
    DepthGuard(Parser& p, int& depth, int limit, const char* what) : depth_(depth) {
      if (++depth_ > limit) {
        --depth_;
        p.fail(std::string(what) + " nested deeper than the limit of " + std::to_string(limit));
      }
    }
    ~DepthGuard() { --depth_; }
    DepthGuard(const DepthGuard&) = delete;
    DepthGuard& operator=(const DepthGuard&) = delete;

   private:
    int& depth_;
  };

  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  bool at_end() const { return pos_ >= s_.size(); }
  void skip_spaces() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t')) ++pos_;
  }
  void skip_blank() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool try_consume(const std::string& lit) {
    skip_spaces();
    if (s_.compare(pos_, lit.size(), lit) == 0) {
      pos_ += lit.size();
      return true;
    }
    return false;
  }
  void expect(const std::string& lit) {
    if (!try_consume(lit)) fail("expected '" + lit + "'");
  }
  void expect_line_end() {
    skip_spaces();
    if (at_end()) return;
    if (peek() != '\n') fail("expected end of line");
    ++pos_;
  }
  static bool ident_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }
  std::string identifier() {
    skip_spaces();
    size_t start = pos_;
    while (pos_ < s_.size() && ident_char(s_[pos_])) ++pos_;
    if (start == pos_) fail("expected a name");
    return s_.substr(start, pos_ - start);
  }
  // Qualified target: letters, digits, '_', ':' and '.'.
  std::string target_text() {
    skip_spaces();
    size_t start = pos_;
    while (pos_ < s_.size() && (ident_char(s_[pos_]) || s_[pos_] == ':' || s_[pos_] == '.')) ++pos_;
    if (start == pos_) fail("expected an operator target");
    return s_.substr(start, pos_ - start);
  }

  std::vector<int64_t> int_list(char close) {
    std::vector<int64_t> out;
    skip_spaces();
    if (peek() == close) {
      ++pos_;
      return out;
    }
    while (true) {
      Arg a = number();
      if (a.kind != Arg::Kind::Int) fail("expected an integer");
      out.push_back(a.i);
      skip_spaces();
      if (peek() == close) {
        ++pos_;
        return out;
      }
      expect(",");
    }
  }

  Type parse_type() {
    skip_spaces();
    if (peek() == '(') {
      DepthGuard guard(*this, type_depth_, kMaxTypeDepth, "tuple types");
      ++pos_;
      std::vector<Type> elems;
      skip_spaces();
      if (peek() != ')') {
        while (true) {
          elems.push_back(parse_type());
          skip_spaces();
          if (peek() == ')') break;
          expect(",");
        }
      }
      ++pos_;
      return Type::make_tuple(std::move(elems));
    }
    std::string word = identifier();
    if (word == "int") return Type::make_scalar(Type::Kind::Int);
    if (word == "float") return Type::make_scalar(Type::Kind::Float);
    if (word == "bool") return Type::make_scalar(Type::Kind::Bool);
    if (word == "none") return Type::make_scalar(Type::Kind::None);
    auto dtype = dtype_from_short_name(word);
    if (!dtype) fail("unknown type '" + word + "' (expected f32[...], int, float, bool, none or a tuple)");
    TensorMeta meta;
    meta.dtype = *dtype;
    if (peek() != '[') fail("expected '[' after dtype");
    ++pos_;
    meta.sizes = int_list(']');
    if (peek() == '{') {
      ++pos_;
      meta.strides = int_list('}');
      if (meta.strides.size() != meta.sizes.size()) fail("strides and sizes differ in rank");
    }
    for (size_t d = 0; d < meta.sizes.size(); ++d)
      if (meta.sizes[d] < 0) fail("negative size " + std::to_string(meta.sizes[d]) + " at dim " + std::to_string(d));
    if (peek() == '@') {
      ++pos_;
      size_t start = pos_;
      while (pos_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == ':')) ++pos_;
      try {
        meta.device = c10::Device(s_.substr(start, pos_ - start));
      } catch (const c10::Error&) {
        fail("bad device '" + s_.substr(start, pos_ - start) + "'");
      }
    }
    try {
      meta.numel();  // refuses element counts that overflow int64
      return Type::make_tensor(std::move(meta));
    } catch (const c10::Error& e) {
      fail(e.msg());
    }
  }

  std::string string_literal() {
    skip_spaces();
    if (peek() != '"') fail("expected a string literal");
    ++pos_;
    std::string out;
    while (true) {
      if (at_end() || peek() == '\n') fail("unterminated string literal");
      char c = s_[pos_++];
      if (c == '"') return out;
      if (c == '\\') {
        if (at_end()) fail("unterminated string literal");
        char e = s_[pos_++];
        out += e == 'n' ? '\n' : e;
        continue;
      }
      out += c;
    }
  }

  Arg number() {
    skip_spaces();
    size_t start = pos_;
    if (peek() == '-' || peek() == '+') ++pos_;
    if (s_.compare(pos_, 3, "inf") == 0) {
      pos_ += 3;
      return Arg::of_float(s_[start] == '-' ? -HUGE_VAL : HUGE_VAL);
    }
    bool is_float = false;
    while (pos_ < s_.size()) {
      char c = s_[pos_];
      if (std::isdigit(static_cast<unsigned char>(c))) {
        ++pos_;
      } else if (c == '.' || c == 'e' || c == 'E') {
        is_float = true;
        ++pos_;
        if ((c == 'e' || c == 'E') && (peek() == '-' || peek() == '+')) ++pos_;
      } else {
        break;
      }
    }
    std::string text = s_.substr(start, pos_ - start);
    if (text.empty() || text == "-" || text == "+") fail("expected a number");
    char* end = nullptr;
    if (is_float) {
      double v = std::strtod(text.c_str(), &end);
      if (*end != '\0') fail("malformed float '" + text + "'");
      return Arg::of_float(v);
    }
    errno = 0;
    long long v = std::strtoll(text.c_str(), &end, 10);
    if (*end != '\0' || errno == ERANGE) fail("malformed integer '" + text + "'");
    return Arg::of_int(v);
  }

  Arg parse_arg(Graph& g) {
    skip_spaces();
    char c = peek();
    if (c == '%') {
      ++pos_;
      std::string name = identifier();
      Node* n = g.find(name);
      if (n == nullptr) fail("use of undefined value %" + name);
      return Arg::of_node(n);
    }
    if (c == '[') {
      DepthGuard guard(*this, list_depth_, kMaxListDepth, "argument lists");
      ++pos_;
      std::vector<Arg> items;
      skip_spaces();
      if (peek() == ']') {
        ++pos_;
        return Arg::of_list(std::move(items));
      }
      while (true) {
        items.push_back(parse_arg(g));
        skip_spaces();
        if (peek() == ']') {
          ++pos_;
          return Arg::of_list(std::move(items));
        }
        expect(",");
      }
    }
    if (c == '"') return Arg::of_string(string_literal());
    if (std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '+') return number();
    if (try_consume("None")) return Arg::none();
    if (try_consume("True")) return Arg::of_bool(true);
    if (try_consume("False")) return Arg::of_bool(false);
    if (try_consume("nan")) return Arg::of_float(std::nan(""));
    if (try_consume("inf")) return Arg::of_float(HUGE_VAL);
    if (try_consume("device(")) {
      std::string d = string_literal();
      expect(")");
      try {
        return Arg::of_device(c10::Device(d));
      } catch (const c10::Error&) {
        fail("bad device '" + d + "'");
      }
    }
    if (s_.compare(pos_, 6, "torch.") == 0) {
      size_t start = pos_;
      pos_ += 6;
      std::string word = "torch." + identifier();
      if (auto dt = dtype_from_torch_name(word)) return Arg::of_dtype(*dt);
      if (word == "torch.strided") return Arg::of_layout(c10::Layout::Strided);
      if (word == "torch.sparse_coo") return Arg::of_layout(c10::Layout::Sparse);
      if (word == "torch.sparse_csr") return Arg::of_layout(c10::Layout::SparseCsr);
      if (word == "torch.contiguous_format") return Arg::of_memory_format(c10::MemoryFormat::Contiguous);
      if (word == "torch.preserve_format") return Arg::of_memory_format(c10::MemoryFormat::Preserve);
      if (word == "torch.channels_last") return Arg::of_memory_format(c10::MemoryFormat::ChannelsLast);
      if (word == "torch.channels_last_3d") return Arg::of_memory_format(c10::MemoryFormat::ChannelsLast3d);
      pos_ = start;
      fail("unknown constant '" + word + "'");
    }
    fail("expected an argument");
  }

  // Positional args then kwargs, up to and including ')'.
  void parse_call_args(Graph& g, std::vector<Arg>& args, Kwargs& kwargs) {
    skip_spaces();
    if (peek() == ')') {
      ++pos_;
      return;
    }
    while (true) {
      skip_spaces();
      size_t save = pos_;
      bool is_kwarg = false;
      if (std::isalpha(static_cast<unsigned char>(peek())) || peek() == '_') {
        std::string key = identifier();
        skip_spaces();
        if (peek() == '=') {
          ++pos_;
          kwargs.emplace_back(key, parse_arg(g));
          is_kwarg = true;
        } else {
          pos_ = save;
        }
      }
      if (!is_kwarg) {
        if (!kwargs.empty()) fail("positional argument after keyword argument");
        args.push_back(parse_arg(g));
      }
      skip_spaces();
      if (peek() == ')') {
        ++pos_;
        return;
      }
      expect(",");
    }
  }

  std::unique_ptr<Graph> parse_graph() {
    auto g = std::make_unique<Graph>();
    expect("graph:");
    expect_line_end();
    while (true) {
      skip_blank();
      if (at_end()) fail("graph has no return statement");
      if (try_consume("return")) {
        expect("(");
        std::vector<Arg> vals;
        Kwargs none;
        parse_call_args(*g, vals, none);
        if (!none.empty()) fail("return takes no keyword arguments");
        g->create_output(std::move(vals));
        expect_line_end();
        return g;
      }
      expect("%");
      std::string name = identifier();
      if (g->find(name) != nullptr) fail("redefinition of %" + name);
      expect(":");
      Type type = parse_type();
      expect("=");
      std::string head = target_text();
      expect("(");
      Node* node = nullptr;
      if (auto role = input_role_from_string(head)) {
        skip_spaces();
        std::string state_name = peek() == '"' ? string_literal() : "";
        expect(")");
        if (!g->nodes().empty() && g->nodes().back()->kind() != NodeKind::Placeholder)
          fail("placeholder %" + name + " must come before every call");
        node = g->create_placeholder(name, *role, std::move(type), std::move(state_name));
      } else {
        Target target;
        try {
          target = Target::parse(head);
        } catch (const c10::Error& e) {
          fail(e.msg());
        }
        std::vector<Arg> args;
        Kwargs kwargs;
        parse_call_args(*g, args, kwargs);
        node = g->create_call(name, std::move(target), std::move(args), std::move(kwargs), std::move(type));
        while (try_consume("{")) {
          DepthGuard guard(*this, region_depth_, kMaxRegionDepth, "regions");
          expect_line_end();
          skip_blank();
          g->add_region(node, parse_graph());
          skip_blank();
          expect("}");
        }
      }
      skip_spaces();
      if (peek() == '#') {
        ++pos_;
        skip_spaces();
        size_t start = pos_;
        while (!at_end() && peek() != '\n') ++pos_;
        std::string path = s_.substr(start, pos_ - start);
        while (!path.empty() && path.back() == ' ') path.pop_back();
        node->set_module_path(path);
      }
      expect_line_end();
    }
  }

  const std::string& s_;
  size_t pos_ = 0;
  int type_depth_ = 0;
  int list_depth_ = 0;
  int region_depth_ = 0;
};

}  // namespace

std::unique_ptr<Graph> parse(const std::string& text) { return Parser(text).parse_top(); }

}  // namespace torch_ext::ir
