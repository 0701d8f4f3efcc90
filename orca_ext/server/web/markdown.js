// A small Markdown renderer for model replies: fenced and inline code, headings, emphasis,
// strike-through, links, lists (nested by indentation), block quotes, tables, rules and
// paragraphs. Every piece of the input is HTML-escaped before it reaches the output, which
// holds only the tags written here; links keep http(s), mailto and same-site addresses only.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

export function renderMarkdown(source) {
  // \u0000 marks placeholders in renderInline; the input may not contain it.
  return renderBlocks(source.replace(/\r\n?/g, "\n").replace(/\u0000/g, "").split("\n"));
}

function renderBlocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (!line.trim()) {
      i++;
    } else if ((match = FENCE.exec(line))) {
      const fence = match[1];
      const code = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) code.push(lines[i]);
      i++;  // the closing fence (a reply still streaming may not have it yet)
      const language = match[2] ? ` class="language-${escapeHtml(match[2])}"` : "";
      out.push(`<pre><code${language}>${escapeHtml(code.join("\n"))}</code></pre>`);
    } else if ((match = HEADING.exec(line))) {
      const level = match[1].length;
      out.push(`<h${level}>${renderInline(match[2])}</h${level}>`);
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) quoted.push(lines[i].replace(QUOTE, ""));
      out.push(`<blockquote>${renderBlocks(quoted)}</blockquote>`);
    } else if (ITEM.test(line)) {
      i = renderList(lines, i, out);
    } else if (line.includes("|") && i + 1 < lines.length && lines[i + 1].includes("|") &&
               TABLE_RULE.test(lines[i + 1])) {
      i = renderTable(lines, i, out);
    } else {
      const paragraph = [];
      for (; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) {
        paragraph.push(lines[i].trim());
      }
      out.push(`<p>${paragraph.map(renderInline).join("<br>")}</p>`);
    }
  }
  return out.join("");
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
         ITEM.test(line);
}

// A list from lines[start]: its items are the lines at its indentation with the same kind of
// marker; more-indented lines (and lines continuing an item) belong to the item before them.
function renderList(lines, start, out) {
  const first = ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  let i = start;
  while (i < lines.length) {
    const line = lines[i];
    const match = ITEM.exec(line);
    if (match && match[1].length <= indent) {
      if (/\d/.test(match[2]) !== ordered || match[1].length < indent) break;
      items.push([match[3]]);
      i++;
    } else if (line.trim() && (line.search(/\S/) > indent || !startsBlock(line))) {
      items[items.length - 1].push(line.slice(Math.min(line.search(/\S/), indent + 2)));
      i++;
    } else if (!line.trim() && i + 1 < lines.length && lines[i + 1].search(/\S/) > indent) {
      items[items.length - 1].push("");
      i++;
    } else {
      break;
    }
  }
  const tag = ordered ? "ol" : "ul";
  const number = ordered ? parseInt(first[2], 10) : 1;
  const from = ordered && number !== 1 ? ` start="${number}"` : "";
  const body = items.map((item) => {
    const html = renderBlocks(item);
    // A one-paragraph item shows without the paragraph's margins.
    const tight = html.startsWith("<p>") && html.indexOf("<p>", 1) < 0 ?
      html.slice(3).replace("</p>", "") : html;
    return `<li>${tight}</li>`;
  });
  out.push(`<${tag}${from}>${body.join("")}</${tag}>`);
  return i;
}

function splitRow(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function renderTable(lines, start, out) {
  const header = splitRow(lines[start]);
  const aligns = splitRow(lines[start + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" :
    c.startsWith(":") ? "left" : "");
  const cell = (tag, text, column) => {
    const align = aligns[column] ? ` class="align-${aligns[column]}"` : "";
    return `<${tag}${align}>${renderInline(text)}</${tag}>`;
  };
  let i = start + 2;
  const rows = [];
  for (; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) {
    const cells = splitRow(lines[i]);
    rows.push(`<tr>${header.map((_, c) => cell("td", cells[c] || "", c)).join("")}</tr>`);
  }
  out.push(`<table><thead><tr>${header.map((h, c) => cell("th", h, c)).join("")}</tr></thead>` +
           `<tbody>${rows.join("")}</tbody></table>`);
  return i;
}

const SAFE_URL = /^(https?:\/\/|mailto:|\/(?!\/)|#)/i;

// Inline Markdown on one line of raw text: code spans and links become placeholders first, so
// emphasis never reaches inside them; everything else is escaped before emphasis is applied.
export function renderInline(text) {
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let rest = text.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g,
                          (_, ticks, code) => hold(`<code>${escapeHtml(code.trim())}</code>`));
  rest = rest.replace(/\[([^\]\u0000]+)\]\(\s*([^\s()]+)\s*\)|(https?:\/\/[^\s<>\u0000]*[^\s<>\u0000.,;:!?)\]'"])/g,
    (whole, label, url, bare) => {
      const href = url || bare;
      if (!SAFE_URL.test(href)) return hold(escapeHtml(whole));
      const inner = label ? emphasis(escapeHtml(label)) : escapeHtml(bare);
      return hold(`<a href="${escapeHtml(href)}" target="_blank" rel="noopener noreferrer">` +
                  `${inner}</a>`);
    });
  return emphasis(escapeHtml(rest)).replace(/\u0000(\d+)\u0000/g, (_, n) => held[n]);
}

function emphasis(html) {
  return html
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/\*([^\s*](?:[^*]*[^\s*])?)\*/g, "<em>$1</em>")
    .replace(/(^|[^\w])_([^\s_](?:[^_]*[^\s_])?)_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
}
