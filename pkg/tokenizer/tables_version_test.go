package tokenizer

import (
	"testing"
	"unicode"

	"golang.org/x/text/unicode/norm"
)

// TestTablesMatchToolchain guards classes_hf.go: its overrides are the difference between HF's
// Unicode and the toolchain's, so a toolchain (or golang.org/x/text) with other Unicode tables
// makes them wrong in both directions until they are regenerated.
func TestTablesMatchToolchain(t *testing.T) {
	for _, tc := range []struct {
		name, tables, running string
	}{
		{"unicode", tablesUnicodeVersion, unicode.Version},
		{"golang.org/x/text/unicode/norm", tablesNormVersion, norm.Version},
	} {
		if tc.tables != tc.running {
			t.Errorf("classes_hf.go was generated against %s %s, this build has %s: regenerate it "+
				"(cd pkg && python tokenizer/testdata/gen/gen_classes.py tokenizer/classes_hf.go, with tokenizers==0.23.3)",
				tc.name, tc.tables, tc.running)
		}
	}
}
