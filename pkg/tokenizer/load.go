package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/maphash"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// File names inside a model folder.
const (
	TokenizerFile = "tokenizer.json"
	ConfigFile    = "tokenizer_config.json"
)

// Load reads a model folder holding tokenizer.json and, when present, tokenizer_config.json
// (chat template and special tokens). path may also name the tokenizer.json file itself; the
// config is then looked up beside it.
func Load(path string) (*Tokenizer, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, notFound(path, err)
	}
	dir, tokPath := path, filepath.Join(path, TokenizerFile)
	if !st.IsDir() {
		dir, tokPath = filepath.Dir(path), path
	}
	tokJSON, err := os.ReadFile(tokPath)
	if err != nil {
		return nil, notFound(tokPath, err)
	}
	cfgPath := filepath.Join(dir, ConfigFile)
	cfgJSON, err := os.ReadFile(cfgPath)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			return nil, notFound(cfgPath, err)
		}
		cfgJSON, cfgPath = nil, ""
	}
	return fromJSON(tokPath, tokJSON, cfgPath, cfgJSON)
}

// FromJSON builds a tokenizer from the contents of tokenizer.json and (optionally, nil when
// absent) tokenizer_config.json.
func FromJSON(tokenizerJSON, configJSON []byte) (*Tokenizer, error) {
	cfgName := ""
	if configJSON != nil {
		cfgName = ConfigFile
	}
	return fromJSON(TokenizerFile, tokenizerJSON, cfgName, configJSON)
}

func notFound(path string, err error) error {
	return &LoadError{Path: path, Kind: ErrNotFound, Err: err}
}

// JSON shapes of tokenizer.json (only what byte-level BPE models use).
type fileJSON struct {
	AddedTokens   []addedTokenJSON `json:"added_tokens"`
	Normalizer    json.RawMessage  `json:"normalizer"`
	PreTokenizer  json.RawMessage  `json:"pre_tokenizer"`
	PostProcessor json.RawMessage  `json:"post_processor"`
	Decoder       json.RawMessage  `json:"decoder"`
	Model         *modelJSON       `json:"model"`
}

type addedTokenJSON struct {
	ID         *uint32 `json:"id"`
	Content    string  `json:"content"`
	SingleWord bool    `json:"single_word"`
	LStrip     bool    `json:"lstrip"`
	RStrip     bool    `json:"rstrip"`
	Normalized bool    `json:"normalized"`
	Special    bool    `json:"special"`
}

type modelJSON struct {
	Type                    string            `json:"type"`
	Dropout                 *float64          `json:"dropout"`
	UnkToken                *string           `json:"unk_token"`
	ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
	ByteFallback            bool              `json:"byte_fallback"`
	IgnoreMerges            bool              `json:"ignore_merges"`
	Vocab                   map[string]uint32 `json:"vocab"`
	Merges                  json.RawMessage   `json:"merges"`
}

type componentJSON struct {
	Type           string            `json:"type"`
	Normalizers    []json.RawMessage `json:"normalizers"`
	Pretokenizers  []json.RawMessage `json:"pretokenizers"`
	Processors     []json.RawMessage `json:"processors"`
	Pattern        *patternJSON      `json:"pattern"`
	Behavior       string            `json:"behavior"`
	Invert         bool              `json:"invert"`
	AddPrefixSpace bool              `json:"add_prefix_space"`
	UseRegex       *bool             `json:"use_regex"`
	Individual     bool              `json:"individual_digits"`
	Single         []templatePiece   `json:"single"`
}

type patternJSON struct {
	Regex  *string `json:"Regex"`
	String *string `json:"String"`
}

type templatePiece struct {
	SpecialToken *struct {
		ID string `json:"id"`
	} `json:"SpecialToken"`
	Sequence *struct {
		ID string `json:"id"`
	} `json:"Sequence"`
}

func isNull(raw json.RawMessage) bool {
	return len(bytes.TrimSpace(raw)) == 0 || string(bytes.TrimSpace(raw)) == "null"
}

func fromJSON(tokPath string, tokJSON []byte, cfgPath string, cfgJSON []byte) (*Tokenizer, error) {
	initClasses()
	var f fileJSON
	if err := json.Unmarshal(tokJSON, &f); err != nil {
		return nil, corrupt(tokPath, err, "not a tokenizer.json")
	}
	if f.Model == nil {
		return nil, corrupt(tokPath, nil, "no \"model\" section")
	}
	t := &Tokenizer{}
	if err := t.loadModel(tokPath, f.Model); err != nil {
		return nil, err
	}
	norm, err := parseNormalizer(tokPath, f.Normalizer)
	if err != nil {
		return nil, err
	}
	t.norm = norm
	if t.stages, err = parsePreTokenizer(tokPath, f.PreTokenizer, nil); err != nil {
		return nil, err
	}
	if err := t.parsePostProcessor(tokPath, f.PostProcessor, f.AddedTokens); err != nil {
		return nil, err
	}
	if err := t.loadAdded(tokPath, f.AddedTokens); err != nil {
		return nil, err
	}
	if cfgJSON != nil {
		if err := t.loadConfig(cfgPath, cfgJSON); err != nil {
			return nil, err
		}
	}
	return t, nil
}

func (t *Tokenizer) loadModel(path string, m *modelJSON) error {
	if m.Type != "BPE" && m.Type != "" {
		return unsupported(path, "model type %q (only byte-level BPE is implemented)", m.Type)
	}
	if m.Dropout != nil && *m.Dropout != 0 {
		return unsupported(path, "BPE dropout %v", *m.Dropout)
	}
	if m.ByteFallback {
		return unsupported(path, "BPE byte_fallback (SentencePiece-style models)")
	}
	if (m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "") || (m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "") {
		return unsupported(path, "BPE continuing_subword_prefix/end_of_word_suffix")
	}
	if len(m.Vocab) == 0 {
		return corrupt(path, nil, "empty model vocab")
	}
	b := &bpe{vocab: make(map[string]uint32, len(m.Vocab)), ignoreMerges: m.IgnoreMerges}
	b.cache.seed = maphash.MakeSeed()
	t.idToToken = make(map[uint32]string, len(m.Vocab))
	for tok, id := range m.Vocab {
		t.idToToken[id] = tok
		raw, ok := unmapByteLevel(tok)
		if !ok {
			continue // not a byte-level string: only reachable as an added token
		}
		b.vocab[raw] = id
		if len(raw) == 1 {
			b.byteID[raw[0]], b.hasByte[raw[0]] = id, true
		}
	}
	nBytes := 0
	for _, ok := range b.hasByte {
		if ok {
			nBytes++
		}
	}
	if nBytes < 200 {
		return unsupported(path, "vocabulary holds %d of the 256 byte-level symbols: not a byte-level BPE", nBytes)
	}
	merges, err := parseMerges(m.Merges)
	if err != nil {
		return corrupt(path, err, "model merges")
	}
	b.merges = newMergeTable(len(merges))
	for rank, mg := range merges {
		a, okA := m.Vocab[mg[0]]
		c, okB := m.Vocab[mg[1]]
		id, okM := m.Vocab[mg[0]+mg[1]]
		if !okA || !okB || !okM {
			return corrupt(path, nil, "merge %d (%q %q) names a token outside the vocabulary", rank, mg[0], mg[1])
		}
		// A pair listed twice keeps its last rank, as HF's map collection does.
		b.merges.put(mergeKey(a, c), mergeVal{rank: uint32(rank), id: id})
	}
	t.model = b
	return nil
}

// parseMerges accepts both encodings: ["a b", ...] and [["a", "b"], ...].
func parseMerges(raw json.RawMessage) ([][2]string, error) {
	if isNull(raw) {
		return nil, nil
	}
	var strs []string
	if err := json.Unmarshal(raw, &strs); err == nil {
		out := make([][2]string, len(strs))
		for i, s := range strs {
			a, b, ok := strings.Cut(s, " ")
			if !ok {
				return nil, fmt.Errorf("merge %d %q is not two tokens", i, s)
			}
			out[i] = [2]string{a, b}
		}
		return out, nil
	}
	var pairs [][]string
	if err := json.Unmarshal(raw, &pairs); err != nil {
		return nil, err
	}
	out := make([][2]string, len(pairs))
	for i, p := range pairs {
		if len(p) != 2 {
			return nil, fmt.Errorf("merge %d has %d parts", i, len(p))
		}
		out[i] = [2]string{p[0], p[1]}
	}
	return out, nil
}

func parseNormalizer(path string, raw json.RawMessage) (normForm, error) {
	if isNull(raw) {
		return normNone, nil
	}
	var c componentJSON
	if err := json.Unmarshal(raw, &c); err != nil {
		return 0, corrupt(path, err, "normalizer")
	}
	switch c.Type {
	case "NFC":
		return normNFC, nil
	case "NFKC":
		return normNFKC, nil
	case "Sequence":
		form := normNone
		for _, sub := range c.Normalizers {
			f, err := parseNormalizer(path, sub)
			if err != nil {
				return 0, err
			}
			if f != normNone {
				if form != normNone {
					return 0, unsupported(path, "more than one Unicode normalization in a Sequence")
				}
				form = f
			}
		}
		return form, nil
	}
	return 0, unsupported(path, "normalizer %q", c.Type)
}

// parsePreTokenizer returns the Split stages in order (ByteLevel without its own regex adds
// none: the byte mapping is implicit in the BPE).
func parsePreTokenizer(path string, raw json.RawMessage, stages []matcher) ([]matcher, error) {
	if isNull(raw) {
		return stages, nil
	}
	var c componentJSON
	if err := json.Unmarshal(raw, &c); err != nil {
		return nil, corrupt(path, err, "pre_tokenizer")
	}
	switch c.Type {
	case "Sequence":
		for _, sub := range c.Pretokenizers {
			var err error
			if stages, err = parsePreTokenizer(path, sub, stages); err != nil {
				return nil, err
			}
		}
		return stages, nil
	case "ByteLevel":
		if c.AddPrefixSpace {
			return nil, unsupported(path, "ByteLevel pre-tokenizer with add_prefix_space")
		}
		if c.UseRegex == nil || *c.UseRegex {
			stages = append(stages, gpt2{})
		}
		return stages, nil
	case "Split":
		if c.Pattern == nil || (c.Pattern.Regex == nil && c.Pattern.String == nil) {
			return nil, corrupt(path, nil, "Split pre-tokenizer without a pattern")
		}
		if c.Pattern.Regex == nil {
			return nil, unsupported(path, "Split on a string pattern")
		}
		if c.Behavior != "Isolated" || c.Invert {
			return nil, unsupported(path, "Split behavior %q invert=%v (only Isolated)", c.Behavior, c.Invert)
		}
		m, ok := lookupRegex(*c.Pattern.Regex)
		if !ok {
			return nil, unsupported(path, "pre-tokenizer regex %q", *c.Pattern.Regex)
		}
		return append(stages, m), nil
	case "Digits":
		if !c.Individual {
			return append(stages, numbersRun{}), nil
		}
		return append(stages, numbers{max: 1}), nil
	}
	return nil, unsupported(path, "pre-tokenizer %q", c.Type)
}

// numbersRun is the Digits pre-tokenizer without individual_digits: runs of \p{N}.
type numbersRun struct{}

func (numbersRun) matchAt(s string, i int) int {
	if e := run(s, i, cN); e > i {
		return e
	}
	return -1
}

func (t *Tokenizer) parsePostProcessor(path string, raw json.RawMessage, added []addedTokenJSON) error {
	if isNull(raw) {
		return nil
	}
	var c componentJSON
	if err := json.Unmarshal(raw, &c); err != nil {
		return corrupt(path, err, "post_processor")
	}
	switch c.Type {
	case "ByteLevel":
		return nil
	case "Sequence":
		for _, sub := range c.Processors {
			if err := t.parsePostProcessor(path, sub, added); err != nil {
				return err
			}
		}
		return nil
	case "TemplateProcessing":
		seen := false
		for _, p := range c.Single {
			switch {
			case p.Sequence != nil:
				seen = true
			case p.SpecialToken != nil:
				id, ok := lookupAdded(added, p.SpecialToken.ID)
				if !ok {
					return corrupt(path, nil, "post_processor names unknown token %q", p.SpecialToken.ID)
				}
				if seen {
					t.postSuffix = append(t.postSuffix, id)
				} else {
					t.postPrefix = append(t.postPrefix, id)
				}
			}
		}
		return nil
	}
	return unsupported(path, "post_processor %q", c.Type)
}

func lookupAdded(added []addedTokenJSON, content string) (uint32, bool) {
	for _, a := range added {
		if a.Content == content && a.ID != nil {
			return *a.ID, true
		}
	}
	return 0, false
}

func (t *Tokenizer) loadAdded(path string, added []addedTokenJSON) error {
	t.special = make(map[uint32]bool)
	t.addedIDs = make(map[uint32]bool)
	var toks []addedToken
	for i, a := range added {
		if a.ID == nil || a.Content == "" {
			return corrupt(path, nil, "added token %d lacks an id or content", i)
		}
		t.idToToken[*a.ID] = a.Content
		t.addedIDs[*a.ID] = true
		if a.Special {
			t.special[*a.ID] = true
		}
		if a.SingleWord {
			return unsupported(path, "added token %q with single_word", a.Content)
		}
		content := a.Content
		if a.Normalized {
			content = t.norm.apply(content)
		}
		toks = append(toks, addedToken{content: content, id: *a.ID, lstrip: a.LStrip, rstrip: a.RStrip, normalized: a.Normalized})
	}
	// Longest first, so the first candidate that matches at a position is the longest one.
	sort.SliceStable(toks, func(i, j int) bool { return len(toks[i].content) > len(toks[j].content) })
	t.rawAdded = newAddedSet(toks, false)
	t.normAdded = newAddedSet(toks, true)
	return nil
}

// configJSON is the part of tokenizer_config.json this package uses.
type configJSON struct {
	ChatTemplate json.RawMessage `json:"chat_template"`
	BOS          json.RawMessage `json:"bos_token"`
	EOS          json.RawMessage `json:"eos_token"`
	PAD          json.RawMessage `json:"pad_token"`
	UNK          json.RawMessage `json:"unk_token"`
}

// tokenString reads a special-token entry: a string, null, or an AddedToken object.
func tokenString(raw json.RawMessage) (any, error) {
	if isNull(raw) {
		return nil, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var obj struct {
		Content string `json:"content"`
	}
	if err := json.Unmarshal(raw, &obj); err != nil {
		return nil, err
	}
	return obj.Content, nil
}

func (t *Tokenizer) loadConfig(path string, raw []byte) error {
	var c configJSON
	if err := json.Unmarshal(raw, &c); err != nil {
		return corrupt(path, err, "not a tokenizer_config.json")
	}
	t.specialVars = map[string]any{}
	for name, r := range map[string]json.RawMessage{"bos_token": c.BOS, "eos_token": c.EOS, "pad_token": c.PAD, "unk_token": c.UNK} {
		v, err := tokenString(r)
		if err != nil {
			return corrupt(path, err, "%s", name)
		}
		t.specialVars[name] = v
	}
	if isNull(c.ChatTemplate) {
		return nil
	}
	var tmpl string
	if err := json.Unmarshal(c.ChatTemplate, &tmpl); err != nil {
		// A list of named templates: [{"name": "default", "template": "..."}, ...].
		var named []struct {
			Name     string `json:"name"`
			Template string `json:"template"`
		}
		if err2 := json.Unmarshal(c.ChatTemplate, &named); err2 != nil {
			return corrupt(path, err, "chat_template")
		}
		for _, n := range named {
			if n.Name == "default" {
				tmpl = n.Template
			}
		}
		if tmpl == "" {
			return unsupported(path, "chat_template list without a \"default\" entry")
		}
	}
	ct, err := compileTemplate(tmpl)
	if err != nil {
		return &LoadError{Path: path, Kind: ErrUnsupported, Detail: "chat_template does not compile", Err: err}
	}
	t.chat = ct
	return nil
}
