// A small Markdown renderer for untrusted text (model replies). It builds DOM nodes and puts
// every piece of the text into them as text nodes (never innerHTML), so a reply's `<script>` or
// `<img onerror=...>` is shown, not run. The subset: code fences (``` or ~~~, unterminated ones
// run to the end, as while a reply streams), headings, lists (nested by indentation), block
// quotes, rules, paragraphs (a single newline is a line break); inline code, bold, italic,
// strikethrough, and links whose target is http(s), mailto or this site.
"use strict";

const renderMarkdown = (() => {
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const INLINE = new RegExp([
    /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source,  // 1, 2: code
    /\*\*(?=\S)([\s\S]*?\S)\*\*/.source,           // 3: bold
    /(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)/.source,   // 4: bold
    /~~(?=\S)([\s\S]*?\S)~~/.source,               // 5: strikethrough
    /\*(?=[^\s*])([\s\S]*?[^\s*])\*/.source,       // 6: italic
    /(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/.source,  // 7: italic, not inside snake_case
    /\[([^\]\n]+)\]\(\s*([^\s)]+)\s*\)/.source,    // 8, 9: link
  ].join("|"));
  const SAFE_URL = /^(https?:\/\/|mailto:|\/(?!\/)|#)/i;

  function el(tag, parent, text) {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }

  function inline(text, parent) {
    while (text) {
      const m = INLINE.exec(text);
      if (!m) break;
      if (m.index) parent.appendChild(document.createTextNode(text.slice(0, m.index)));
      if (m[2] !== undefined) el("code", parent, m[2]);
      else if (m[3] !== undefined || m[4] !== undefined) inline(m[3] ?? m[4], el("strong", parent));
      else if (m[5] !== undefined) inline(m[5], el("del", parent));
      else if (m[6] !== undefined || m[7] !== undefined) inline(m[6] ?? m[7], el("em", parent));
      else if (SAFE_URL.test(m[9])) {
        const a = el("a", parent);
        a.href = m[9];
        a.rel = "noopener noreferrer";
        a.target = "_blank";
        inline(m[8], a);
      } else parent.appendChild(document.createTextNode(m[0]));  // an unsafe target stays text
      text = text.slice(m.index + m[0].length);
    }
    if (text) parent.appendChild(document.createTextNode(text));
  }

  // Lines of a paragraph, with line breaks between them.
  function paragraph(lines, parent) {
    const p = el("p", parent);
    lines.forEach((line, i) => {
      if (i) el("br", p);
      inline(line.trim(), p);
    });
  }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  function codeBlock(lines, i, parent) {
    const [, fence, lang] = FENCE.exec(lines[i]);
    const close = new RegExp(`^ {0,3}${fence[0] === "`" ? "`" : "~"}{${fence.length},}\\s*$`);
    const body = [];
    for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
    const pre = el("pre", parent);
    if (lang) pre.dataset.lang = lang;
    el("code", pre, body.join("\n"));
    return i + 1;
  }

  function list(lines, i, parent) {
    const first = ITEM.exec(lines[i]);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const node = el(ordered ? "ol" : "ul", parent);
    if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
      const body = [m[3]];
      // The item goes on while lines are indented past its marker (a nested list among them) or
      // continue its text; a blank line ends it unless an indented line follows.
      for (i++; i < lines.length; i++) {
        const line = lines[i];
        const deeper = line.length - line.trimStart().length > indent;
        if (line.trim() === "") {
          const next = lines[i + 1];
          if (next === undefined || next.length - next.trimStart().length <= indent) break;
          body.push("");
        } else if (deeper) body.push(line.slice(Math.min(indent + 2, line.length - line.trimStart().length)));
        else if (!startsBlock(line)) body.push(line);
        else break;
      }
      const li = el("li", node);
      blocks(body, li);
      if (li.firstChild && li.firstChild.tagName === "P") li.firstChild.replaceWith(...li.firstChild.childNodes);  // a tight item
      while (i < lines.length && lines[i].trim() === "") i++;
    }
    return i;
  }

  function blocks(lines, parent) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (line.trim() === "") i++;
      else if (FENCE.test(line)) i = codeBlock(lines, i, parent);
      else if ((m = HEADING.exec(line))) {
        inline(m[2], el(`h${m[1].length}`, parent));
        i++;
      } else if (RULE.test(line)) {
        el("hr", parent);
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) body.push(lines[i].replace(QUOTE, ""));
        blocks(body, el("blockquote", parent));
      } else if (ITEM.test(line)) i = list(lines, i, parent);
      else {
        const body = [line];
        for (i++; i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i]); i++) body.push(lines[i]);
        paragraph(body, parent);
      }
    }
  }

  // The nodes for `text`, in a DocumentFragment.
  return function render(text) {
    const fragment = document.createDocumentFragment();
    blocks(String(text).replace(/\r\n?/g, "\n").split("\n"), fragment);
    return fragment;
  };
})();
