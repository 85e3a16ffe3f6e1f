package router

import (
	"strconv"
	"strings"
	"testing"

	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"

	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestParseIDMatchesParseUint: the decision id parser accepts exactly the ids whose rest after
// the prefix strconv.ParseUint takes (base 10, 64 bits) with a non-zero value, and gives the
// same number.
func TestParseIDMatchesParseUint(t *testing.T) {
	s := New(routertest.New(), zerolog.Nop(), nil)
	for _, rest := range []string{
		"", "0", "1", "007", "42", "-1", "+1", "1_000", " 1", "1 ", "1a", "a1", "١", "9",
		strconv.FormatUint(1<<63, 10), "9999999999999999999", "18446744073709551615", "18446744073709551616",
		"99999999999999999999", "00000000000000000001", "000000000000000000001", strings.Repeat("9", 30),
		"12345678901234567890", "1/", ":", "/",
	} {
		want, err := strconv.ParseUint(rest, 10, 64)
		wantOK := err == nil && want != 0
		if !wantOK {
			want = 0
		}
		got, ok := s.parseID(s.prefix + rest)
		if ok != wantOK || got != want {
			t.Errorf("parseID(prefix+%q) = %d, %v; want %d, %v", rest, got, ok, want, wantOK)
		}
	}
	for seq := uint64(1); seq < 1<<62; seq = seq*7 + 3 {
		if got, ok := s.parseID(s.id(seq)); !ok || got != seq {
			t.Fatalf("parseID(id(%d)) = %d, %v", seq, got, ok)
		}
	}
	if _, ok := s.parseID("other-1"); ok {
		t.Error("an id without the prefix parsed")
	}
}

// TestOutcomeIDCheckedOnce: an outcome's decision id that parses as this leader's is not
// validated again; what ValidateID refuses still gets INVALID_ARGUMENT with its message,
// including an id of ours made longer than MaxIDLen by leading zeros.
func TestOutcomeIDCheckedOnce(t *testing.T) {
	s := New(routertest.New(), zerolog.Nop(), nil)
	for _, tc := range []struct {
		id, msg string
	}{
		{"", "decision_id is required"},
		{s.prefix + strings.Repeat("0", kvcv1.MaxIDLen) + "1", "longer than"},
		{"a/b", "forbidden character"},
		{"\xff", "not valid UTF-8"},
	} {
		resp := s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{
			DecisionId: tc.id, Success: true, ErrorKind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE}}})
		e := resp.GetError()
		if e == nil || codes.Code(e.Code) != codes.InvalidArgument || !strings.Contains(e.Message, tc.msg) {
			t.Errorf("outcome for %.40q: %v, want INVALID_ARGUMENT with %q", tc.id, resp, tc.msg)
		}
	}
	// Ours and well formed: past validation (not pending: NOT_FOUND, never issued).
	resp := s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{
		DecisionId: s.id(7), Success: true, ErrorKind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE}}})
	if e := resp.GetError(); e == nil || codes.Code(e.Code) != codes.NotFound {
		t.Errorf("outcome for an id of ours never issued: %v, want NOT_FOUND", resp)
	}
}

// TestDecisionIDDigits: a decision's id written into its answer's block is Service.id's (the
// prefix and strconv's decimal digits), from one digit to twenty.
func TestDecisionIDDigits(t *testing.T) {
	s := New(routertest.New(), zerolog.Nop(), nil)
	var m decisionMsg
	seqs := []uint64{1, 9, 10, 99, 100, 12345, 1<<53 - 1, 1<<63 + 5, 1<<64 - 1}
	for v := uint64(1); v < 1<<62; v = v*10 + 7 {
		seqs = append(seqs, v, v-1)
	}
	for _, seq := range seqs {
		if got, want := m.setID(s.prefix, seq), s.prefix+strconv.FormatUint(seq, 10); got != want {
			t.Fatalf("setID(%d) = %q, want %q", seq, got, want)
		}
		if got := string(appendDecimal([]byte("x"), seq)); got != "x"+strconv.FormatUint(seq, 10) {
			t.Fatalf("appendDecimal(%d) = %q", seq, got)
		}
	}
}
