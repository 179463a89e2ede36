// A small Markdown subset to HTML. The whole input is HTML-escaped before anything else, so
// the only tags in the output are the ones written here; model text never becomes markup.
// Blocks: paragraphs, ATX headings, fenced code (an unclosed fence runs to the end, as while
// streaming), bullet and numbered lists, block quotes, rules. Inline: code spans, links
// (http, https and mailto only), bold, italics, strikethrough.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const SAFE_URL = /^(https?:\/\/|mailto:)[^\s]*$/i;

function emphasis(text) {
  return text
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
}

function inline(text) {
  // Code spans and links are set aside first (as \0N\0), so emphasis never reaches into
  // code or into a URL.
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let out = text.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, __, code) => {
    return hold(`<code>${code.replace(/^ ([\s\S]*[^ ][\s\S]*) $/, "$1")}</code>`);
  });
  // [text](url) with a safe scheme; any other target stays plain text. The URL is already
  // escaped, so it cannot leave the attribute.
  out = out.replace(/\[([^\]\n]+)\]\(([^()\s]+)\)/g, (whole, label, url) => {
    if (!SAFE_URL.test(url)) return whole;
    const a = `<a href="${url}" target="_blank" rel="noopener noreferrer">`;
    return hold(`${a}${emphasis(label)}</a>`);
  });
  out = emphasis(out);
  const restore = (s) => s.replace(/\u0000(\d+)\u0000/g, (_, i) => restore(held[Number(i)]));
  return restore(out);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^ {0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^ {0,3}(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^ {0,3}&gt;\s?(.*)$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;

export function renderMarkdown(source) {
  const lines = escapeHtml(String(source).replace(/\u0000/g, "")).split(/\r?\n/);
  const html = [];
  let para = [];
  const flush = () => {
    if (para.length) html.push(`<p>${inline(para.join("\n")).replace(/\n/g, "<br>")}</p>`);
    para = [];
  };
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = FENCE.exec(line))) {
      flush();
      const fence = m[1];
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence)) body.push(lines[i++]);
      i++; // the closing fence (or past the end)
      const lang = m[2] ? ` class="language-${m[2]}"` : "";
      html.push(`<pre><code${lang}>${body.join("\n")}</code></pre>`);
      continue;
    }
    if (line.trim() === "") {
      flush();
      i++;
      continue;
    }
    if ((m = HEADING.exec(line))) {
      flush();
      const level = m[1].length;
      html.push(`<h${level}>${inline(m[2])}</h${level}>`);
      i++;
      continue;
    }
    if (RULE.test(line)) {
      flush();
      html.push("<hr>");
      i++;
      continue;
    }
    if (QUOTE.test(line)) {
      flush();
      const quoted = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        quoted.push(m[1]);
        i++;
      }
      html.push(`<blockquote>${renderQuoted(quoted)}</blockquote>`);
      continue;
    }
    const bullet = BULLET.exec(line);
    const numbered = bullet ? null : NUMBERED.exec(line);
    if (bullet || numbered) {
      flush();
      const pattern = bullet ? BULLET : NUMBERED;
      const items = [];
      while (i < lines.length) {
        if ((m = pattern.exec(lines[i]))) {
          items.push(bullet ? m[1] : m[2]);
        } else if (items.length && /^\s+\S/.test(lines[i]) && !FENCE.test(lines[i])) {
          items[items.length - 1] += `\n${lines[i].trim()}`; // a continuation line
        } else {
          break;
        }
        i++;
      }
      const start = numbered && numbered[1] !== "1" ? ` start="${Number(numbered[1])}"` : "";
      const tag = bullet ? "ul" : "ol";
      const lis = items.map((t) => `<li>${inline(t).replace(/\n/g, "<br>")}</li>`).join("");
      html.push(`<${tag}${start}>${lis}</${tag}>`);
      continue;
    }
    para.push(line);
    i++;
  }
  flush();
  return html.join("\n");
}

// A block quote's lines are already escaped: render them as Markdown again without
// escaping twice.
function renderQuoted(lines) {
  const unescaped = lines.join("\n").replace(/&(amp|lt|gt|quot|#39);/g, (e) => {
    return { "&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&#39;": "'" }[e];
  });
  return renderMarkdown(unescaped);
}
