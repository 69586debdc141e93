# Shared by the shell end-to-end tests (sourced): fail and expect_error.
fail() { echo "FAIL: $*"; exit 1; }
# expect_error NAME NEEDLE COMMAND...: COMMAND must exit 2 and print NEEDLE.
expect_error() {
  local name=$1 needle=$2
  shift 2
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  ((rc == 2)) || fail "$name: exit code $rc, expected 2: $out"
  grep -qF -- "$needle" <<<"$out" || fail "$name: '$needle' not in: $out"
  echo "ok $name: $(grep -m1 error <<<"$out")"
}
